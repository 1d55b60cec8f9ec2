"""Interference mode: what one long prompt's prefill does to everyone else on a server.

Each round: (1) with `alone`, the long prompt (`long_len` random ids, 1 output token) on the idle server:
its TTFT alone; (2) `streams` background streams (fresh `stream_len`-token prompts, decoding up to
`stream_output_len` tokens, ignore_eos) start; once each has its first token and `settle` seconds
have passed, the long prompt is sent, and `short_delay` seconds later a short request (`short_len`
tokens, 1 output token); when both have their first token the streams are cancelled (the client closes
them; the server aborts them). Reported per round: the long prompt's TTFT alone and under load, the
short request's TTFT, and the streams' inter-token gaps before the long prompt was sent and during its
prefill (a gap overlapping [long sent, long's first token]): p50, p99, max, and how many streams
stalled (a gap over 1 s) during it. That is the head-of-line blocking chunked prefill removes
(`--max-num-batched-tokens`, `--itl-target-ms`). HTTP only; times on the client (perf_counter)."""
import asyncio
import random
import sys
import time

import httpx

from burstserve.clients.report import write_result_files
from burstserve.clients.sse import StreamRecord, read_stream
from burstserve.clients.stats import summarize
from burstserve.clients.sweep import config_fields, config_label, server_info

STALL_SECONDS = 1.0


# ---- pure computations -----------------------------------------------------------------------------------
def split_gaps(token_times: list[float], window: tuple[float, float]) -> tuple[list[float], list[float]]:
    """A stream's inter-token gaps -> (those ending before window[0], those overlapping the window)."""
    before, during = [], []
    start, end = window
    for a, b in zip(token_times, token_times[1:]):
        if b <= start:
            before.append(b - a)
        elif a < end:
            during.append(b - a)
    return before, during


def round_summary(alone_ttft: float | None, long_sent: float, long_first: float, short_sent: float | None,
                  short_first: float | None, streams: list[StreamRecord]) -> dict:
    """One round's figures (seconds in, milliseconds out for the gaps)."""
    window = (long_sent, long_first)
    before, during, stalled, in_window = [], [], 0, 0
    for s in streams:
        b, d = split_gaps(s.token_times, window)
        before += b
        during += d
        stalled += any(g > STALL_SECONDS for g in d)
        in_window += sum(1 for t in s.token_times if window[0] < t <= window[1])
    under_load = long_first - long_sent
    out = {"long_ttft_alone_s": alone_ttft, "long_ttft_under_load_s": under_load,
           "ratio": under_load / alone_ttft if alone_ttft else None,
           "short_ttft_s": short_first - short_sent if short_first is not None else None,
           "itl_before_count": len(before), "itl_during_count": len(during), "stalled_streams": stalled,
           "streams_tokens_per_s_during": in_window / (window[1] - window[0]) if window[1] > window[0] else 0.0}
    for name, gaps in (("before", before), ("during", during)):
        out.update({k.replace("itl", f"itl_{name}"): v for k, v in summarize("itl", gaps).items()})
        out[f"max_itl_{name}_ms"] = max(gaps) * 1e3 if gaps else 0.0
    return out


def table(result: dict) -> str:
    lines = [f"Interference, {result['label']}: {result['streams']} streams of {result['stream_len']} tokens decoding; "
             f"a {result['long_len']}-token prompt arrives, and a {result['short_len']}-token request "
             f"{result['short_delay']} s after it. TTFT in seconds; ITL (the streams' gaps between tokens) in ms, "
             "before the long prompt and during its prefill; stalled: streams with a gap over 1 s during it.", "",
             "| round | long TTFT alone s | long TTFT under load s | ratio | short TTFT s | ITL before p50 / p99 ms | "
             "ITL during p50 / p99 / max ms | stalled streams |", "|---|" + "---|" * 7]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)        # noqa: E731
    for i, r in enumerate(result["rounds"], 1):
        lines.append(f"| {i} | {fmt(r['long_ttft_alone_s'], '.3f')} | {r['long_ttft_under_load_s']:.3f} | "
                     f"{fmt(r['ratio'], '.2f')} | {fmt(r['short_ttft_s'], '.3f')} | "
                     f"{r['median_itl_before_ms']:.1f} / {r['p99_itl_before_ms']:.1f} | "
                     f"{r['median_itl_during_ms']:.1f} / {r['p99_itl_during_ms']:.1f} / {r['max_itl_during_ms']:.1f} | "
                     f"{r['stalled_streams']} of {result['streams']} |")
    if result.get("error"):
        lines += ["", f"**Error** (the run stopped): {result['error']}"]
    return "\n".join(lines) + "\n"


# ---- driving the server ----------------------------------------------------------------------------------
def _body(model: str, ids: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": ids, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict, into: StreamRecord,
                  first: asyncio.Event | None = None) -> None:
    """Reads one stream into `into`; `first` is set at its first token (or when it ends without one)."""
    try:
        await read_stream(client, url, body, headers, into, first.set if first is not None else None)
    finally:
        if first is not None:
            first.set()


async def one_round(url: str, model: str, vocab: int, args, headers: dict, rng: random.Random, alone: bool) -> dict:
    ids = lambda n: [rng.randrange(vocab) for _ in range(n)]         # noqa: E731
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        alone_ttft = None
        if alone:
            solo = StreamRecord()
            await _stream(client, url, _body(model, ids(args.long_len), 1), headers, solo)
            _check([solo], "the long prompt alone")
            alone_ttft = solo.token_times[0] - solo.sent
        streams = [StreamRecord() for _ in range(args.streams)]
        firsts = [asyncio.Event() for _ in streams]
        tasks = [asyncio.create_task(_stream(client, url, _body(model, ids(args.stream_len), args.stream_output_len),
                                             headers, s, e)) for s, e in zip(streams, firsts)]
        try:
            for e in firsts:
                await e.wait()
            _check([s for s in streams if s.error], "a background stream")
            await asyncio.sleep(args.settle)
            long, short = StreamRecord(), StreamRecord()
            long_task = asyncio.create_task(_stream(client, url, _body(model, ids(args.long_len), 1), headers, long))
            short_task = None
            if args.short_len:
                await asyncio.sleep(args.short_delay)
                short_task = asyncio.create_task(_stream(client, url, _body(model, ids(args.short_len), 1), headers,
                                                         short))
            await long_task
            if short_task is not None:
                await short_task
            _check([long] + ([short] if short_task else []), "the long prompt or the short request under load")
            await _next_tokens(streams, long.token_times[0])      # closes each stream's gap over the window
            if any(s.finished or s.error for s in streams):
                raise RuntimeError("a background stream ended before the measurement did: raise --stream-output-len"
                                   if not any(s.error for s in streams) else
                                   next(s.error for s in streams if s.error))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    summary = round_summary(alone_ttft, long.sent, long.token_times[0], short.sent if short_task else None,
                            short.token_times[0] if short_task else None, streams)
    origin = min(s.sent for s in streams)          # the round's start: its first stream sent (seconds from it)
    rel = lambda t: None if t is None else t - origin         # noqa: E731
    summary["raw"] = {"long_sent": rel(long.sent), "long_first": rel(long.token_times[0]),
                      "short_sent": rel(short.sent) if short_task else None,
                      "short_first": rel(short.token_times[0]) if short_task else None,
                      "streams": [[rel(t) for t in s.token_times] for s in streams]}
    return summary


async def _next_tokens(streams: list[StreamRecord], after: float, limit: float = 60.0) -> None:
    """Waits until every stream has a token after `after` (so a stall that spans the window's end is
    measured whole), at most `limit` seconds."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        if all(s.finished or s.error or (s.token_times and s.token_times[-1] > after) for s in streams):
            return
        await asyncio.sleep(0.005)
    raise RuntimeError(f"a background stream produced no token in the {limit:.0f} s after the long prompt's first")


def _check(streams: list[StreamRecord], what: str) -> None:
    for s in streams:
        if s.error:
            raise RuntimeError(f"{what}: {s.error}")
        if not s.token_times:
            raise RuntimeError(f"{what}: the stream ended without a token")


CSV_COLUMNS = ["round", "long_ttft_alone_s", "long_ttft_under_load_s", "ratio", "short_ttft_s", "median_itl_before_ms",
               "p99_itl_before_ms", "median_itl_during_ms", "p99_itl_during_ms", "max_itl_during_ms",
               "stalled_streams", "streams_tokens_per_s_during"]


def write_results(output_dir: str, result: dict) -> None:
    write_result_files(output_dir, result, CSV_COLUMNS, [{**r, "round": i} for i, r in enumerate(result["rounds"], 1)],
                       table(result))


def run_interference(args, url: str, meta: dict) -> dict:
    """--warmup unmeasured rounds (the long prompt alone), then --repeats measured ones; results written
    after each; an error ends the run (written down, exit status 1)."""
    server = server_info(url, args.api_key)
    fields, vocab = config_fields(server), server.get("vocab_size", 1000)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    result = {"mode": "interference", **meta, "label": args.label or config_label(fields, False), **fields,
              "streams": args.streams, "stream_len": args.stream_len, "stream_output_len": args.stream_output_len,
              "long_len": args.long_len, "short_len": args.short_len, "short_delay": args.short_delay,
              "settle": args.settle, "alone": args.alone, "warmup": args.warmup, "repeats": args.repeats,
              "seed": args.seed, "server": server, "rounds": [], "error": None}
    rng = random.Random(args.seed)
    try:
        for _ in range(args.warmup):          # the first prefill of a length builds kernel plans
            solo = StreamRecord()
            asyncio.run(_warm(url, server["id"], [rng.randrange(vocab) for _ in range(args.long_len)], headers, solo))
            _check([solo], "the warm-up long prompt")
        for _ in range(args.repeats):
            result["rounds"].append(asyncio.run(one_round(url, server["id"], vocab, args, headers, rng, args.alone)))
            write_results(args.output_dir, result)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    write_results(args.output_dir, result)
    print(table(result))
    if result["error"]:
        print(f"burstserve bench interference: error: {result['error']}", file=sys.stderr)
        sys.exit(1)
    return result


async def _warm(url: str, model: str, ids: list[int], headers: dict, into: StreamRecord) -> None:
    async with httpx.AsyncClient() as client:
        await _stream(client, url, _body(model, ids, 1), headers, into)

"""Shared mode: the time to first token a user of a long-document server sees, cold and warm.

Document mode (default): a document of `doc_len` random token ids, then `questions` questions on it, each
the document followed by `question_len` fresh random ids. The first (document + question 1) is cold: the
whole prompt is prefilled. The others are warm: the document's K/V should come from the prefix cache, and
only the question is prefilled. Multi-turn mode (`turns` > 0): a conversation whose first turn is
`doc_len` + `question_len` random ids and whose turn t is turn t-1's prompt, its answer (`output_len`
generated tokens, exactly: ignore_eos) and `question_len` new ids; turn 1 is cold, the others warm.
Many-documents mode (`documents` > 1): `documents` fresh documents, each prefilled once (cold), then
`rounds` rounds of one question per document, round robin: with more documents than the GPU's KV pool
holds, a question finds its document in the pool, in the KV host tier (--kv-offload-gb), or nowhere, and
the table gives TTFT by where the prefix came from (offline from prefill_stats' host_cached_tokens, over
HTTP from the server's prefix_cache_host_hits counter around each request).
Each repeat takes a fresh document (conversation, set of documents); `warmup` unmeasured ones come first.

Every request reports how many prompt tokens came from the prefix cache: offline the engine's
prefill_stats.cached_tokens, over HTTP the final usage chunk's prompt_tokens_details.cached_tokens
(stream_options.include_usage). A warm request with none is reported loudly: the server most likely
runs without --enable-prefix-caching. TTFT is measured as the sweep measures it: over HTTP on the client,
the first streamed token chunk (ttft_probe.stream_once); offline from the engine's RequestMetrics."""
import asyncio
import contextlib
import json
import random
import statistics
import sys
from dataclasses import dataclass

import httpx

from burstserve.clients.report import write_result_files
from burstserve.clients.stats import summarize
from burstserve.clients.sweep import (check_generated, config_fields, config_label, engine_timing, metric_totals,
                                      offline_llm, offline_llm_args, random_prompt, server_info)
from burstserve.clients.ttft_probe import completion_body, stream_once

MULTI_TURN_OUTPUT_LEN = 128     # --output-len's default in multi-turn mode (document mode: 1)
PREFILL_SUM = "burstserve:request_prefill_time_seconds_sum"
HOST_HITS = "burstserve:prefix_cache_host_hits_total"
SOURCES = ("gpu", "host", "none")   # where a question's cached prefix came from


@dataclass
class Sample:
    """One measured request."""
    prompt_tokens: int
    cached_tokens: int          # of its prompt, found in the prefix cache
    ttft: float                 # seconds
    server_prefill: float       # seconds the server (its workers) spent prefilling it
    answer: list[int]           # the generated token ids (over HTTP: only when asked for)
    adopt: float = 0.0          # offline: seconds finding the cached prefix and copying it (0 over HTTP)
    queued: float = 0.0         # offline: seconds from submitting it to the scheduler taking it up
    call: float = 0.0           # offline: seconds of the workers' prefill calls as the scheduler saw them
    host_cached_tokens: int = 0  # of cached_tokens, restored from the KV host tier


# ---- one request, offline or over HTTP -------------------------------------------------------------------
def offline_sender(llm, output_len: int):
    """send(prompt, want_answer) -> Sample, through the LLM in this process."""
    from burstserve.engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    def send(prompt: list[int], want_answer: bool) -> Sample:
        out = llm.generate([prompt], params)[0]
        answer = list(out.outputs[0].token_ids)
        check_generated(len(answer), output_len)
        m = out.metrics
        s = m.prefill_stats
        return Sample(len(prompt), s.cached_tokens or 0, engine_timing(m).ttft, m.prefill_seconds or 0.0, answer,
                      s.adopt_seconds or 0.0, s.queued_seconds or 0.0, s.call_seconds or 0.0, s.host_cached_tokens or 0)
    return send


def http_sender(url: str, model: str, api_key: str | None, output_len: int):
    """send(prompt, want_answer) -> Sample: one streamed completion with the usage chunk; the answer's token
    ids come from its logprobs (return_tokens_as_token_ids) when asked for."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def send(prompt: list[int], want_answer: bool) -> Sample:
        body = dict(completion_body(model, 0, 1, output_len), prompt=prompt)   # the sweep's request, this prompt
        if want_answer:
            body.update(logprobs=0, return_tokens_as_token_ids=True)
        before = metric_totals(url, PREFILL_SUM, HOST_HITS)
        timing, chunks = asyncio.run(_stream(url, body, headers))
        prefill, host_hits = (b - a for a, b in zip(before, metric_totals(url, PREFILL_SUM, HOST_HITS)))
        usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
        if usage is None:
            raise RuntimeError("the stream carried no usage chunk (stream_options.include_usage)")
        if usage.get("prompt_tokens") != len(prompt):
            raise RuntimeError(f"sent {len(prompt)} prompt tokens, usage says {usage.get('prompt_tokens')}")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        answer = [int(name.removeprefix("token_id:")) for c in chunks for choice in c.get("choices") or []
                  for name in (choice.get("logprobs") or {}).get("tokens", [])] if want_answer else []
        if want_answer and len(answer) != output_len:
            raise RuntimeError(f"{output_len} tokens generated, {len(answer)} token ids in the stream's logprobs")
        return Sample(len(prompt), cached, timing.ttft, prefill, answer, host_cached_tokens=int(host_hits))
    return send


async def _stream(url: str, body: dict, headers: dict) -> tuple:
    """ttft_probe.stream_once (the sweep's TTFT) over a client that keeps the stream's lines -> (its timing,
    the stream's JSON chunks)."""
    async with httpx.AsyncClient() as client:
        recorder = _RecordingClient(client)
        timing = await stream_once(recorder, url, body, headers)
    return timing, [json.loads(line[6:]) for line in recorder.lines if line.startswith("data: {")]


class _RecordingClient:
    """An httpx.AsyncClient whose streamed responses also keep every line they yield."""

    def __init__(self, client: httpx.AsyncClient):
        self.client, self.lines = client, []

    @contextlib.asynccontextmanager
    async def stream(self, *args, **kwargs):
        async with self.client.stream(*args, **kwargs) as response:
            yield _RecordingResponse(response, self.lines)


class _RecordingResponse:
    def __init__(self, response: httpx.Response, lines: list[str]):
        self.response, self.lines = response, lines

    def __getattr__(self, name):
        return getattr(self.response, name)

    async def aiter_lines(self):
        async for line in self.response.aiter_lines():
            self.lines.append(line)
            yield line


# ---- one document or conversation ------------------------------------------------------------------------
def document_run(send, vocab: int, doc_len: int, question_len: int, questions: int, rng, progress) -> list[dict]:
    """One fresh document and its questions -> one record per request, the cold one first."""
    document = random_prompt(vocab, doc_len, rng)
    records = []
    for i in range(questions):
        s = send(document + random_prompt(vocab, question_len, rng), False)
        records.append(_record(i + 1, s, doc_len if i else 0))
        progress.update(1)
    return records


def conversation_run(send, vocab: int, doc_len: int, question_len: int, turns: int, rng, progress) -> list[dict]:
    """One fresh conversation -> one record per turn. A turn's expected cache hit is the previous turn's prompt
    and answer but its last token (whose K/V was never computed: it was sampled, not fed)."""
    prompt, records, previous = random_prompt(vocab, doc_len + question_len, rng), [], None
    for turn in range(1, turns + 1):
        if previous is not None:
            prompt = prompt + previous.answer + random_prompt(vocab, question_len, rng)
        expected = previous.prompt_tokens + len(previous.answer) - 1 if previous is not None else 0
        previous = send(prompt, turn < turns)
        records.append(_record(turn, previous, expected))
        progress.update(1)
    return records


def documents_run(send, vocab: int, doc_len: int, question_len: int, documents: int, rounds: int, rng,
                  progress) -> list[dict]:
    """Many documents: each prefilled once with a first question (cold), then `rounds` rounds of a question per
    document, round robin -> one record per request, the cold ones first, each with its round, its document
    and where its prefix came from."""
    docs = [random_prompt(vocab, doc_len, rng) for _ in range(documents)]
    records = []
    for r in range(rounds + 1):
        for d, document in enumerate(docs):
            s = send(document + random_prompt(vocab, question_len, rng), False)
            records.append(dict(_record(len(records) + 1, s, doc_len if r else 0), round=r, document=d + 1,
                                warm=r > 0))
            progress.update(1)
    return records


def source(record: dict) -> str:
    """Where the request's cached prefix came from: the GPU's pool, the KV host tier, or nowhere."""
    return "host" if record.get("host_cached_tokens") else "gpu" if record["cached_tokens"] else "none"


def by_source(runs: list[list[dict]]) -> dict:
    """Many-documents mode: the cold requests' TTFT (round 0), and the warm ones' by where their prefix came
    from (ms statistics and the count of each)."""
    cold = [x["ttft_ms"] / 1e3 for run in runs for x in run if not x["warm"]]
    out = {"cold": {"count": len(cold), **summarize("ttft", cold), "max_ttft_ms": max(cold) * 1e3} if cold else
           {"count": 0}}
    for name in SOURCES:
        ttft = [x["ttft_ms"] / 1e3 for run in runs for x in run if x["warm"] and source(x) == name]
        out[name] = {"count": len(ttft), **summarize("ttft", ttft), "max_ttft_ms": max(ttft) * 1e3} if ttft else \
            {"count": 0}
    return out


def _record(index: int, s: Sample, expected: int) -> dict:
    return {"index": index, "warm": index > 1, "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
            "host_cached_tokens": s.host_cached_tokens, "expected_cached_tokens": expected, "ttft_ms": s.ttft * 1e3,
            "server_prefill_ms": s.server_prefill * 1e3, "adopt_ms": s.adopt * 1e3, "queued_ms": s.queued * 1e3,
            "call_ms": s.call * 1e3}


# ---- summaries -------------------------------------------------------------------------------------------
def summary(runs: list[list[dict]]) -> dict:
    """Cold and warm TTFT over runs (each a document's or conversation's records, the cold one first): the
    TTFT statistics (ms) of the cold and of the warm requests, the warm requests' largest TTFT and cached
    tokens, and the speed-up mean cold / mean warm."""
    cold = [r[0] for r in runs]
    warm = [x for r in runs for x in r[1:]]
    cold_s, warm_s = [x["ttft_ms"] / 1e3 for x in cold], [x["ttft_ms"] / 1e3 for x in warm]
    cached = [x["cached_tokens"] for x in warm]
    out = {**summarize("cold_ttft", cold_s), **summarize("warm_ttft", warm_s),
           "max_warm_ttft_ms": max(warm_s) * 1e3 if warm_s else 0.0,
           "cold_cached_tokens": [x["cached_tokens"] for x in cold],
           "min_warm_cached_tokens": min(cached, default=0), "max_warm_cached_tokens": max(cached, default=0),
           "mean_warm_cached_tokens": statistics.fmean(cached) if cached else 0.0,
           "warm_without_cache_hit": sum(1 for c in cached if c == 0)}
    out["speedup"] = out["mean_cold_ttft_ms"] / out["mean_warm_ttft_ms"] if out["mean_warm_ttft_ms"] else None
    return out


def per_turn(runs: list[list[dict]]) -> list[dict]:
    """Multi-turn: each turn over the conversations: its prompt length, cached tokens and TTFT."""
    lines = []
    for turn in zip(*runs):
        ttfts = [x["ttft_ms"] for x in turn]
        lines.append({"turn": turn[0]["index"], "prompt_tokens": turn[0]["prompt_tokens"],
                      "cached_tokens": [x["cached_tokens"] for x in turn], "ttft_ms_samples": ttfts,
                      "mean_ttft_ms": statistics.fmean(ttfts), "max_ttft_ms": max(ttfts)})
    return lines


def cache_warnings(runs: list[list[dict]]) -> list[str]:
    """A line per measured warm request that got no cache hit or less of one than expected."""
    lines = []
    for j, run in enumerate(runs, 1):
        for x in run[1:]:
            if x["cached_tokens"] == 0:
                lines.append(f"repeat {j}, request {x['index']}: no prefix-cache hit (cached_tokens 0, "
                             f"{x['expected_cached_tokens']} expected): its TTFT is a cold prefill")
            elif x["cached_tokens"] < x["expected_cached_tokens"]:
                lines.append(f"repeat {j}, request {x['index']}: {x['cached_tokens']} cached tokens, fewer than the "
                             f"{x['expected_cached_tokens']} expected (evicted?)")
    return lines


def _seconds(ms: float) -> str:
    return f"{ms / 1e3:.3f}"


def _span(values: list[int]) -> str:
    low, high = min(values, default=0), max(values, default=0)
    return str(low) if low == high else f"{low}-{high}"


def documents_table(result: dict) -> str:
    """results.md of many-documents mode: TTFT by where the prefix came from."""
    lines = [f"Many documents, {result['label']}: {result['documents']} documents of {result['doc_len']} tokens, "
             f"each prefilled once with a question (cold), then {result['rounds']} round(s) of a "
             f"{result['question_len']}-token question per document, round robin; {result['output_len']} output "
             "token(s). Time to first token in seconds, by where the question's cached prefix came from "
             "(gpu: the KV pool; host: the KV host tier; none: prefilled whole).", "",
             "| prefix from | requests | TTFT s mean | p50 | p99 | max |", "|---|---|---|---|---|---|"]
    groups = by_source(result["runs"]) if result["runs"] else {}
    for name in ("cold",) + SOURCES:
        g = groups.get(name, {"count": 0})
        if not g["count"]:
            lines.append(f"| {name} | 0 | - | - | - | - |")
            continue
        lines.append(f"| {name} | {g['count']} | {_seconds(g['mean_ttft_ms'])} | {_seconds(g['median_ttft_ms'])} | "
                     f"{_seconds(g['p99_ttft_ms'])} | {_seconds(g['max_ttft_ms'])} |")
    lines += ["", "| round | " + " | ".join(f"doc {d}" for d in range(1, result["documents"] + 1)) + " |",
              "|---|" + "---|" * result["documents"]]
    for r in range(result["rounds"] + 1):
        cells = [f"{x['ttft_ms'] / 1e3:.3f} ({source(x) if x['warm'] else 'cold'})"
                 for run in result["runs"][:1] for x in run if x["round"] == r]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    if result.get("error"):
        lines += ["", f"**Error** (the run stopped): {result['error']}"]
    return "\n".join(lines) + "\n"


def table(result: dict) -> str:
    """results.md: a line per repeat and one over all of them; in multi-turn mode also a line per turn."""
    if result["kind"] == "documents":
        return documents_table(result)
    multi = result["kind"] == "multi-turn"
    if multi:
        head = (f"Multi-turn, {result['label']}: {result['turns']} turns, the first {result['doc_len']} + "
                f"{result['question_len']} tokens, each next one the previous prompt, its {result['output_len']}-token "
                f"answer and {result['question_len']} new tokens. Cold: turn 1; warm: the later turns.")
    else:
        head = (f"Shared document, {result['label']}: a {result['doc_len']}-token document, {result['questions']} "
                f"questions of {result['question_len']} new tokens each, {result['output_len']} output token(s). "
                "Cold: the document's first question; warm: the others.")
    unit = "conversation" if multi else "document"
    lines = [head + " Time to first token in seconds; cached: prompt tokens per warm request found in the prefix "
             "cache; speed-up: mean cold / mean warm TTFT.", "",
             f"| {unit} | cold TTFT s | warm TTFT s mean | warm p50 | warm max | cached tokens (warm) | "
             "speed-up cold/warm |", "|---|" + "---|" * 6]
    runs = result["runs"]
    rows = [(str(j), summary([run])) for j, run in enumerate(runs, 1)]
    if len(runs) > 1:
        rows.append(("all", result["summary"]))
    for name, s in rows:
        speedup = f"{s['speedup']:.2f}x" if s["speedup"] else "-"
        lines.append(f"| {name} | {_seconds(s['mean_cold_ttft_ms'])} | {_seconds(s['mean_warm_ttft_ms'])} | "
                     f"{_seconds(s['median_warm_ttft_ms'])} | {_seconds(s['max_warm_ttft_ms'])} | "
                     f"{_span([s['min_warm_cached_tokens'], s['max_warm_cached_tokens']])} | {speedup} |")
    if multi and runs:
        lines += ["", "| turn | prompt tokens | cached tokens | TTFT s mean | TTFT s max |", "|---|---|---|---|---|"]
        lines += [f"| {t['turn']} | {t['prompt_tokens']} | {_span(t['cached_tokens'])} | {_seconds(t['mean_ttft_ms'])} "
                  f"| {_seconds(t['max_ttft_ms'])} |" for t in result["per_turn"]]
    if result.get("warnings"):
        lines += ["", f"**Warning**: {len(result['warnings'])} warm request(s) with less of a cache hit than "
                  "expected:", ""] + [f"- {w}" for w in result["warnings"]]
    if result.get("error"):
        lines += ["", f"**Error** (the run stopped): {result['error']}"]
    return "\n".join(lines) + "\n"


CSV_COLUMNS = ["repeat", "index", "round", "document", "warm", "prompt_tokens", "cached_tokens", "host_cached_tokens",
               "expected_cached_tokens", "ttft_ms", "server_prefill_ms", "adopt_ms", "queued_ms", "call_ms"]


def write_results(output_dir: str, result: dict) -> None:
    """results.json (everything), results.csv (a line per request) and results.md (the table)."""
    lines = [{**x, "repeat": name or j} for name, runs in (("warmup", result["warmup_runs"]), (None, result["runs"]))
             for j, run in enumerate(runs, 1) for x in run]
    write_result_files(output_dir, result, CSV_COLUMNS, lines, table(result))


# ---- the mode --------------------------------------------------------------------------------------------
def run_shared(args, url: str | None, meta: dict) -> dict:
    """Measures --warmup then --repeats documents (conversations), offline or against `url`; writes the
    results after each one, prints the table and the warnings -> the result. An error ends the run: what was
    measured is written and the run exits with status 1."""
    from tqdm import tqdm
    multi, many = args.turns > 0, args.documents > 1
    output_len = args.output_len or (MULTI_TURN_OUTPUT_LEN if multi else 1)
    per_run = args.turns if multi else args.documents * (args.rounds + 1) if many else args.questions
    with contextlib.ExitStack() as stack:
        if args.offline:
            longest = args.doc_len + (args.turns * (args.question_len + output_len) if multi
                                      else args.question_len + output_len)
            llm_args = offline_llm_args(args, longest, enable_prefix_caching=True)
            llm, fields = stack.enter_context(offline_llm(llm_args))
            send, vocab, server = offline_sender(llm, output_len), llm.model_config.vocab_size, None
        else:
            server = server_info(url, args.api_key)
            fields, vocab = config_fields(server), server.get("vocab_size", 1000)
            send = http_sender(url, server["id"], args.api_key, output_len)
        result = {"mode": "shared", **meta, "kind": "multi-turn" if multi else "documents" if many else "document",
                  "documents": args.documents, "rounds": args.rounds,
                  "label": args.label or config_label(fields, args.offline), **fields, "doc_len": args.doc_len,
                  "question_len": args.question_len, "questions": None if multi else args.questions,
                  "turns": args.turns, "output_len": output_len, "repeats": args.repeats, "warmup": args.warmup,
                  "seed": args.seed, "max_num_batched_tokens": args.max_num_batched_tokens, "server": server,
                  "summary": None, "per_turn": None, "runs": [], "warmup_runs": [], "warnings": [], "error": None}
        rng = random.Random(args.seed)

        def one_run(progress) -> list[dict]:
            if multi:
                return conversation_run(send, vocab, args.doc_len, args.question_len, args.turns, rng, progress)
            if many:
                return documents_run(send, vocab, args.doc_len, args.question_len, args.documents, args.rounds, rng,
                                     progress)
            return document_run(send, vocab, args.doc_len, args.question_len, args.questions, rng, progress)

        with tqdm(total=(args.warmup + args.repeats) * per_run, desc="shared", file=sys.stderr) as bar:
            try:
                for j in range(args.warmup + args.repeats):
                    run = one_run(bar)
                    (result["warmup_runs"] if j < args.warmup else result["runs"]).append(run)
                    _finish(result, multi)
                    write_results(args.output_dir, result)      # a killed run keeps what it measured
            except Exception as e:      # an OOM or a server error: written down, then the run stops
                result["error"] = f"{type(e).__name__}: {e}"
    _finish(result, multi)
    write_results(args.output_dir, result)
    print(table(result))
    if result["warnings"]:
        _shout(result)
    if result["error"]:
        print(f"burstserve bench shared: error: {result['error']}", file=sys.stderr)
        sys.exit(1)
    return result


def _finish(result: dict, multi: bool) -> None:
    runs = result["runs"]
    if result["kind"] == "documents":
        result["summary"] = by_source(runs) if runs else None
        return
    result["summary"] = summary(runs) if runs else None
    result["per_turn"] = per_turn(runs) if multi and runs else None
    result["warnings"] = cache_warnings(runs)


def _shout(result: dict) -> None:
    none = result["summary"]["warm_without_cache_hit"] if result["summary"] else 0
    bar = "!" * 100
    lines = [bar, f"WARNING: {len(result['warnings'])} warm request(s) got less of a prefix-cache hit than expected"]
    if none:
        lines.append(f"WARNING: {none} warm request(s) got NO cache hit (cached_tokens 0): their TTFT is a cold "
                     "prefill. Does the server run without --enable-prefix-caching?")
    lines += [f"  {w}" for w in result["warnings"][:10]] + (["  ..."] if len(result["warnings"]) > 10 else []) + [bar]
    print("\n".join(lines), file=sys.stderr)

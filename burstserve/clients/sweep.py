"""Sweep mode: time to first token over prompt lengths, against a server (HTTP/SSE) or offline (`LLM`);
with an output length, time per output token too; with a batch, generated tokens/s.

Prompts are random token ids of exactly the requested length. Each measurement sends `batch` prompts of
that length together (default 1: one request at a time); every request generates exactly `output_len`
tokens (ignore_eos; default 1: TTFT only). Over HTTP, times are taken on the client (the SSE chunk carrying
each token) and the server's own prefill time is read from its Prometheus counters before and after each
batch; offline, from the engine's RequestMetrics (token times as worker 0 stamped them)."""
import contextlib
import itertools
import random
import statistics

import httpx
from prometheus_client.parser import text_string_to_metric_families

from burstserve.clients.offline_options import offline_options
from burstserve.clients.stats import RequestTiming, batch_throughput, summarize
from burstserve.clients.ttft_probe import stream_batch

DEFAULT_LENGTHS = [4096 << i for i in range(7)]     # 4K .. 256K


def server_info(url: str, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    cards = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"]
    return cards[0]


def prefill_seconds_total(url: str) -> float:
    return metric_totals(url, "burstserve:request_prefill_time_seconds_sum")[0]


def metric_totals(url: str, *names: str) -> list[float]:
    """The server's /metrics samples of these names (0 for one it does not export)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {sample.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if sample.name in names}
    return [values.get(name, 0.0) for name in names]


def config_fields(info: dict) -> dict:
    """A server's configuration (its /v1/models card) as a row's fields: one device per worker."""
    devices = info.get("devices") or []
    strategy = info.get("sp_strategy", "?") + ("" if info.get("overlap", True) else ", no overlap")
    return {"strategy": strategy, **device_fields(devices)}


def device_fields(devices: list[str]) -> dict:
    """The device of each worker ('cuda:0,cuda:2', 'cpu,cpu') and how many workers: the context parallel
    size (num_devices too, the name results before 2026-11-23 have)."""
    return {"devices": ",".join(devices), "num_devices": len(devices), "context_parallel_size": len(devices)}


def default_label(base: str, batch: int) -> str:
    return base + (f", batch {batch}" if batch > 1 else "")


def config_label(fields: dict, offline: bool) -> str:
    """A configuration's default name in tables: its strategy and worker count ('burst, 2 device(s)')."""
    return f"{fields['strategy']}, {fields['context_parallel_size']} device(s)" + (", offline" if offline else "")


def random_prompt(vocab: int, n: int, rng=random) -> list[int]:
    """n random token ids below vocab: a prompt of exactly n tokens that no cache has seen."""
    return [rng.randrange(vocab) for _ in range(n)]


def make_row(label: str, fields: dict, n: int, batches: list[list[RequestTiming]], error: str | None,
             warmups: list[list[RequestTiming]] = (), details: dict | None = None, output_len: int = 1,
             batch: int = 1) -> dict:
    """One prompt length's results over the measured batches (warm-up batches apart): the TTFT of every
    request; with output_len > 1 also every request's TPOT and each batch's generated tokens/s.
    repeats: measured batches; the per-request samples number repeats x batch."""
    timed = [r for b in batches for r in b]
    ttfts, prefills = [r.ttft for r in timed], [r.server_prefill for r in timed]
    row = {"label": label, **fields, "prompt_tokens": n, "batch": batch, "output_len": output_len,
           "repeats": len(batches), "error": error, "ttft_ms_samples": [t * 1e3 for t in ttfts],
           "warmup_ttft_ms_samples": [r.ttft * 1e3 for b in warmups for r in b],
           "server_prefill_ms_samples": [p * 1e3 for p in prefills]}
    row.update(summarize("ttft", ttfts))
    row["mean_server_prefill_ms"] = sum(prefills) / len(prefills) * 1e3 if prefills else 0.0
    if output_len > 1:
        row.update(decode_fields(batches))
    row.update(details or {})
    return row


def decode_fields(batches: list[list[RequestTiming]]) -> dict:
    """Every request's TPOT and end-to-end latency (ms) and each batch's generated tokens/s
    (see stats.batch_throughput)."""
    timed = [r for b in batches for r in b]
    rates = [batch_throughput(b) for b in batches]
    output_rates, decode_rates = [o for o, _ in rates], [d for _, d in rates if d is not None]
    tpots, e2els = [r.tpot for r in timed], [r.token_times[-1] - r.sent for r in timed]
    return {"output_tokens_samples": [len(r.token_times) for r in timed],
            "tpot_ms_samples": [t * 1e3 for t in tpots], **summarize("tpot", tpots),
            "e2el_ms_samples": [t * 1e3 for t in e2els], **summarize("e2el", e2els),
            "output_tokens_per_s_samples": output_rates, "decode_tokens_per_s_samples": decode_rates,
            "mean_output_tokens_per_s": statistics.fmean(output_rates) if output_rates else 0.0,
            "mean_decode_tokens_per_s": statistics.fmean(decode_rates) if decode_rates else 0.0}


def timed_requests(count: int, send, progress) -> tuple[list, str | None]:
    """Calls send() `count` times -> (its results, the error that stopped it or None)."""
    results = []
    for _ in range(count):
        try:
            results.append(send())
        except Exception as e:  # recorded in the row (OOM shows as OOM), and the sweep goes on
            progress.update(count - len(results))
            return results, f"{type(e).__name__}: {e}"
        progress.update(1)
    return results, None


def sweep_http(url: str, lengths: list[int], repeats: int, warmup: int, output_len: int, label: str | None,
               api_key: str | None, progress, batch: int = 1):
    """Yields one row per prompt length. A batch is `batch` concurrent streams; the server's prefill time
    over a batch is shared equally among its requests."""
    info = server_info(url, api_key)
    fields = config_fields(info)
    label = label or default_label(config_label(fields, offline=False), batch)
    vocab = info.get("vocab_size", 1000)

    def send() -> list[RequestTiming]:
        before = prefill_seconds_total(url)
        timings = stream_batch(url, info["id"], n, vocab, api_key, output_len, batch)
        share = (prefill_seconds_total(url) - before) / batch
        for t in timings:
            t.server_prefill = share
        return timings

    for n in lengths:
        warm, error = timed_requests(warmup, send, progress)
        timed, error = timed_requests(repeats, send, progress) if not error else ([], error)
        yield make_row(label, fields, n, timed, error, warm, output_len=output_len, batch=batch)


def offline_llm_args(args, max_model_len: int, max_num_seqs: int = 64, **extra) -> dict:
    """The LLM arguments of an offline run from its command line: --model, the engine options the bench takes
    from engine/options.py's table (clients/offline_options.py, by keyword as parsed), with `extra` ones added."""
    # the context is the longest request; the engine sizes its KV page pool from it and the memory it may
    # use (gpu_memory_utilization's default; 1M tokens a worker on CPU). A request that cannot fit even
    # alone fails as OOM; a batch larger than the pool is preempted and recomputed, as a server would
    return dict(model=args.model, **offline_options(args), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                **extra)


@contextlib.contextmanager
def offline_llm(llm_args: dict):
    """An offline run's LLM, warmed up by one short request -> (the LLM, its configuration as a row's fields:
    strategy, devices, kernel)."""
    from burstserve.engine import LLM, SamplingParams
    with LLM(**llm_args) as llm:
        fields = {"strategy": llm.engine.sp_strategy + ("" if llm.engine.overlap else ", no overlap")
                  + ("" if llm.engine.quantization == "none" else f", {llm.engine.quantization}")
                  + ("" if llm.engine.async_scheduling else ", sync scheduling"),
                  **device_fields(llm.engine.devices), "kernel": llm.kernel}
        llm.generate(random_prompt(llm.model_config.vocab_size, 16), SamplingParams(max_tokens=1))   # warm-up
        yield llm, fields


def sweep_offline(llm_args: dict, lengths: list[int], repeats: int, warmup: int, output_len: int,
                  label: str | None, progress, batch: int = 1):
    """Yields one row per prompt length: the same sweep through the LLM API in this process, a batch being
    one llm.generate call with `batch` prompts. An error (an OOM kills the engine) ends this configuration:
    longer prompts are not tried."""
    from burstserve.engine import SamplingParams
    with offline_llm(llm_args) as (llm, fields):
        label = label or default_label(config_label(fields, offline=True), batch)
        vocab = llm.model_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

        def send() -> list:
            prompts = [random_prompt(vocab, n) for _ in range(batch)]
            outputs = llm.generate(prompts, params)
            for out in outputs:
                check_generated(len(out.outputs[0].token_ids), output_len)
            return [out.metrics for out in outputs]

        for n in lengths:
            warm, error = timed_requests(warmup, send, progress)
            timed, error = timed_requests(repeats, send, progress) if not error else ([], error)
            yield make_row(label, fields, n, engine_batches(timed), error, engine_batches(warm),
                           prefill_details([m for b in timed for m in b]), output_len, batch)
            if error:
                break


def engine_batches(batches: list[list]) -> list[list[RequestTiming]]:
    """Batches of the engine's RequestMetrics as batches of clock readings."""
    return [[engine_timing(m) for m in b] for b in batches]


def engine_timing(metrics) -> RequestTiming:
    """The engine's RequestMetrics as clock readings: the first token's time, then one per decode gap."""
    token_times = list(itertools.accumulate(metrics.decode_seconds, initial=metrics.first_token_time))
    return RequestTiming(metrics.arrival_time, token_times, metrics.prefill_seconds or 0.0)


def check_generated(generated: int, asked: int) -> None:
    if generated != asked:
        raise RuntimeError(f"asked for {asked} tokens (ignore_eos), {generated} were generated")


def prefill_details(metrics: list) -> dict:
    """Means over the measured requests of the workers' prefill figures (exchange, stall, peak memory)."""
    stats = [m.prefill_stats for m in metrics if m.prefill_stats.prefill_seconds is not None]
    if not stats:
        return {}
    mean = lambda key: sum(getattr(s, key) or 0.0 for s in stats) / len(stats)   # noqa: E731
    return {"mean_exchange_ms": mean("exchange_seconds") * 1e3, "mean_exposed_ms": mean("exposed_seconds") * 1e3,
            "hidden_fraction": mean("hidden_fraction"), "mean_setup_ms": mean("setup_seconds") * 1e3,
            "mean_wrapup_ms": mean("wrapup_seconds") * 1e3, "mean_call_ms": mean("call_seconds") * 1e3,
            "peak_memory_gib": max(s.peak_memory_bytes or 0 for s in stats) / 2**30,
            # the way each prompt ran (auto: ulysses or burst; burst-zero: gathered or burst-zero-sliced)
            "prefill_ways": "/".join(sorted({s.strategy for s in stats if s.strategy}))}

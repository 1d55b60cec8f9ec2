"""Sweep mode: time to first token over prompt lengths, against a server (HTTP/SSE) or offline (`LLM`).

Prompts are random token ids of exactly the requested length, sent one at a time. Over HTTP, TTFT is
measured on the client (first SSE chunk carrying a token) and the server's own prefill time is read
from its Prometheus counters before and after each request."""
import random

import httpx
from prometheus_client.parser import text_string_to_metric_families

from clients.stats import summarize
from clients.ttft_probe import ttft_once

DEFAULT_LENGTHS = [4096 << i for i in range(7)]     # 4K .. 256K


def server_info(url: str, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    cards = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"]
    return cards[0]


def prefill_seconds_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "burstserve:request_prefill_time_seconds_sum":
                return sample.value
    return 0.0


def config_fields(info: dict) -> dict:
    """A server's configuration (its /v1/models card) as a row's fields: one device per worker."""
    devices = info.get("devices") or []
    strategy = info.get("sp_strategy", "?") + ("" if info.get("overlap", True) else ", no overlap")
    return {"strategy": strategy, **device_fields(devices)}


def device_fields(devices: list[str]) -> dict:
    """The device of each worker ('cuda:0,cuda:2', 'cpu,cpu') and how many workers: the context parallel
    size (num_devices too, the name results before 2026-11-23 have)."""
    return {"devices": ",".join(devices), "num_devices": len(devices), "context_parallel_size": len(devices)}


def make_row(label: str, fields: dict, n: int, ttfts: list[float], prefills: list[float], error: str | None,
             warmups: list[float] = (), details: dict | None = None) -> dict:
    """One prompt length's results: TTFT summary over the measured repeats (warm-up requests apart)."""
    row = {"label": label, **fields, "prompt_tokens": n, "repeats": len(ttfts), "error": error,
           "ttft_ms_samples": [t * 1e3 for t in ttfts], "warmup_ttft_ms_samples": [t * 1e3 for t in warmups],
           "server_prefill_ms_samples": [p * 1e3 for p in prefills]}
    row.update(summarize("ttft", ttfts))
    row["mean_server_prefill_ms"] = sum(prefills) / len(prefills) * 1e3 if prefills else 0.0
    row.update(details or {})
    return row


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


def sweep_http(url: str, lengths: list[int], repeats: int, warmup: int, max_tokens: int, label: str | None,
               api_key: str | None, progress):
    """Yields one row per prompt length."""
    info = server_info(url, api_key)
    fields = config_fields(info)
    label = label or f"{fields['strategy']}, {fields['context_parallel_size']} device(s)"
    vocab = info.get("vocab_size", 1000)

    def send():
        before = prefill_seconds_total(url)
        ttft = ttft_once(url, info["id"], n, vocab, api_key, max_tokens)
        return ttft, prefill_seconds_total(url) - before

    for n in lengths:
        warm, error = timed_requests(warmup, send, progress)
        timed, error = timed_requests(repeats, send, progress) if not error else ([], error)
        yield make_row(label, fields, n, [t for t, _ in timed], [p for _, p in timed], error, [t for t, _ in warm])


def sweep_offline(llm_args: dict, lengths: list[int], repeats: int, warmup: int, max_tokens: int,
                  label: str | None, progress):
    """Yields one row per prompt length: the same sweep through the LLM API in this process. An error (an OOM kills the engine) ends
    this configuration: longer prompts are not tried."""
    from engine import LLM, SamplingParams
    with LLM(**llm_args) as llm:
        devices = llm.engine.devices
        fields = {"strategy": llm.engine.sp_strategy + ("" if llm.engine.overlap else ", no overlap"),
                  **device_fields(devices), "kernel": llm.kernel}
        label = label or f"{fields['strategy']}, {len(devices)} device(s), offline"
        vocab = llm.model_config.vocab_size
        llm.generate([random.randrange(vocab) for _ in range(16)], SamplingParams(max_tokens=1))   # warm-up
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

        def send():
            return llm.generate([random.randrange(vocab) for _ in range(n)], params)[0].metrics

        for n in lengths:
            warm, error = timed_requests(warmup, send, progress)
            timed, error = timed_requests(repeats, send, progress) if not error else ([], error)
            yield make_row(label, fields, n, [m.time_to_first_token for m in timed],
                           [m.prefill_seconds for m in timed], error,
                           [m.time_to_first_token for m in warm], prefill_details(timed))
            if error:
                break


def prefill_details(metrics: list) -> dict:
    """Means over the measured requests of the workers' prefill figures (exchange, stall, peak memory)."""
    stats = [m.prefill_stats for m in metrics if m.prefill_stats]
    if not stats:
        return {}
    mean = lambda key: sum(s.get(key, 0.0) for s in stats) / len(stats)   # noqa: E731
    return {"mean_exchange_ms": mean("exchange_seconds") * 1e3, "mean_exposed_ms": mean("exposed_seconds") * 1e3,
            "hidden_fraction": mean("hidden_fraction"), "mean_setup_ms": mean("setup_seconds") * 1e3,
            "mean_wrapup_ms": mean("wrapup_seconds") * 1e3, "mean_call_ms": mean("call_seconds") * 1e3,
            "peak_memory_gib": max(s.get("peak_memory_bytes", 0) for s in stats) / 2**30}

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
    devices = info.get("devices") or []
    strategy = info.get("sp_strategy", "?") + ("" if info.get("overlap", True) else ", no overlap")
    return {"strategy": strategy, "devices": ",".join(devices), "num_devices": len(devices)}


def _row(label: str, fields: dict, n: int, ttfts: list[float], prefills: list[float], error: str | None) -> dict:
    row = {"label": label, **fields, "prompt_tokens": n, "repeats": len(ttfts), "error": error,
           "ttft_ms_samples": [t * 1e3 for t in ttfts], "server_prefill_ms_samples": [p * 1e3 for p in prefills]}
    row.update(summarize("ttft", ttfts))
    row["mean_server_prefill_ms"] = sum(prefills) / len(prefills) * 1e3 if prefills else 0.0
    return row


def sweep_http(url: str, lengths: list[int], repeats: int, max_tokens: int, label: str | None,
               api_key: str | None, progress) -> list[dict]:
    info = server_info(url, api_key)
    fields = config_fields(info)
    label = label or f"{fields['strategy']}, {fields['num_devices']} device(s)"
    vocab = info.get("vocab_size", 1000)
    rows = []
    for n in lengths:
        ttfts, prefills, error = [], [], None
        for _ in range(repeats):
            before = prefill_seconds_total(url)
            try:
                ttfts.append(ttft_once(url, info["id"], n, vocab, api_key, max_tokens))
            except Exception as e:  # recorded in the row (OOM shows as OOM), and the sweep goes on
                error = str(e)
                progress.update(repeats - len(ttfts))
                break
            prefills.append(prefill_seconds_total(url) - before)
            progress.update(1)
        rows.append(_row(label, fields, n, ttfts, prefills, error))
    return rows


def sweep_offline(llm_args: dict, lengths: list[int], repeats: int, max_tokens: int, label: str | None,
                  progress) -> list[dict]:
    from engine import LLM, SamplingParams
    with LLM(**llm_args) as llm:
        devices = llm.engine.devices
        fields = {"strategy": llm.engine.sp_strategy + ("" if llm.engine.overlap else ", no overlap"),
                  "devices": ",".join(devices), "num_devices": len(devices)}
        label = label or f"{fields['strategy']}, {len(devices)} device(s), offline"
        vocab = llm.model_config.vocab_size
        llm.generate([random.randrange(vocab) for _ in range(16)], SamplingParams(max_tokens=1))   # warm-up
        rows = []
        for n in lengths:
            ttfts, prefills, error = [], [], None
            for _ in range(repeats):
                try:
                    out = llm.generate([random.randrange(vocab) for _ in range(n)],
                                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
                except Exception as e:  # an OOM kills the engine: record it and stop this configuration
                    error = str(e)
                    break
                finally:
                    progress.update(1)
                ttfts.append(out.metrics.time_to_first_token)
                prefills.append(out.metrics.prefill_seconds)
            rows.append(_row(label, fields, n, ttfts, prefills, error))
            if error:
                break
    return rows

"""Load mode: many requests at a request rate and concurrency cap, reported with the metric names and
JSON keys of `vllm bench serve` (TTFT, TPOT, ITL, E2EL: mean/median/std/p99 in ms; throughputs)."""
import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

from burstserve.clients.sse import read_stream
from burstserve.clients.stats import summarize


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> RequestResult:
    record = await read_stream(client, url, body, headers)
    t = record.token_times
    return RequestResult(ok=record.finished, ttft=t[0] - record.sent if t else 0.0,
                         latency=record.ended - record.sent if record.finished else 0.0, output_tokens=len(t),
                         itl=[b - a for a, b in zip(t, t[1:])], error=record.error)


async def run_load(url: str, model: str, vocab: int, num_prompts: int, input_len: int, output_len: int,
                   request_rate: float, max_concurrency: int | None, api_key: str | None, progress,
                   seed: int = 0) -> dict:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency or num_prompts)
    bodies = [{"model": model, "prompt": [rng.randrange(vocab) for _ in range(input_len)], "max_tokens": output_len,
               "stream": True, "ignore_eos": True, "temperature": 0} for _ in range(num_prompts)]

    async def limited(client, body):
        async with limit:
            res = await one_request(client, url, body, headers)
        progress.update(1)
        return res

    start = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(limited(client, body)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))     # Poisson arrivals
        results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return summarize_load(results, duration, input_len, request_rate, max_concurrency)


def summarize_load(results: list[RequestResult], duration: float, input_len: int, request_rate: float,
                   max_concurrency: int | None) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary = {
        "duration": duration, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": input_len * len(done), "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (input_len * len(done) + out_tokens) / duration,
        "request_rate": request_rate if request_rate != float("inf") else "inf", "max_concurrency": max_concurrency,
    }
    summary.update(summarize("ttft", [r.ttft for r in done]))
    summary.update(summarize("tpot", tpots))
    summary.update(summarize("itl", [gap for r in done for gap in r.itl]))
    summary.update(summarize("e2el", [r.latency for r in done]))
    summary["ttfts"] = [r.ttft for r in done]          # per request, seconds (vllm bench serve's detailed keys)
    summary["e2els"] = [r.latency for r in done]
    summary["errors"] = [r.error for r in results if not r.ok][:10]
    return summary

"""One log line every few seconds while the server is busy, as vLLM writes it: prompt and generation
throughput, running and waiting requests, KV usage per worker."""
import asyncio
import logging
import time

from burstserve.engine.core.messages import EngineFigures
from burstserve.server.async_engine import AsyncEngine

log = logging.getLogger("burstserve.stats")


def stats_line(engine: AsyncEngine, prompt_tps: float, generation_tps: float) -> str:
    stats = engine.llm.stats                                  # engine/core/messages.py EngineFigures
    capacity = stats.kv_capacity_per_worker
    usage = ", ".join(f"{100 * t / capacity:.1f}%" if capacity else "-" for t in stats.kv_tokens_per_worker)
    return (f"prompt throughput {prompt_tps:.1f} tokens/s, generation throughput {generation_tps:.1f} tokens/s, "
            f"running {stats.running} reqs, waiting {engine.waiting} reqs, KV usage per worker [{usage}]"
            + (f", preemptions {stats.num_preemptions}" if stats.num_preemptions else "")
            + host_tier(stats))


def host_tier(stats: EngineFigures) -> str:
    """The KV host tier's part of the line (none without a tier): its usage per worker and tokens restored."""
    capacity = stats.kv_host_capacity_per_worker
    if not capacity:
        return ""
    usage = ", ".join(f"{100 * t / capacity:.1f}%" for t in stats.kv_host_tokens_per_worker)
    return f", KV host tier per worker [{usage}], {stats.prefix_cache_host_hits} tokens restored"


async def log_stats_while_busy(engine: AsyncEngine, interval: float) -> None:
    """Runs until cancelled; logs only intervals in which something ran or waited."""
    last = (time.monotonic(), engine.prompt_tokens, engine.generation_tokens)
    while True:
        await asyncio.sleep(interval)
        now = (time.monotonic(), engine.prompt_tokens, engine.generation_tokens)
        seconds = max(now[0] - last[0], 1e-9)
        busy = now[1:] != last[1:] or engine.waiting or engine.llm.stats.running
        if busy and engine.healthy:
            log.info("%s", stats_line(engine, (now[1] - last[1]) / seconds, (now[2] - last[2]) / seconds))
        last = now

"""Worker 0's figures for the front (LLM.stats, engine/core/messages.py EngineFigures): one EngineStats message
when they change, at most every MIN_INTERVAL_SECONDS while sequences run unless the running and waiting
counts change (those go out at once)."""
import time

from burstserve.engine.cache.kv_manager import KVManager
from burstserve.engine.core.messages import EngineFigures, EngineStats
from burstserve.engine.scheduler.sequences import SchedulerState

MIN_INTERVAL_SECONDS = 0.25


class StatsPublisher:
    def __init__(self, outputs, kv: KVManager):
        self.outputs, self.kv = outputs, kv
        self._sent: tuple | None = None      # the figures last sent, as a comparable key
        self._sent_at = 0.0

    def publish(self, state: SchedulerState, num_preemptions: int, recomputed_tokens: int) -> None:
        """Sends the figures if they changed (see the module docstring)."""
        kv, cache = self.kv, self.kv.prefix_cache
        tokens = kv.tokens_per_worker()                 # in use; prefix-cache entries count as free (vLLM)
        waiting = len(state.waiting) + len(state.preempted) + (state.prefilling is not None)
        key = (len(state.running), waiting, tuple(tokens), num_preemptions, cache.queries if cache else 0,
               cache.hits if cache else 0, recomputed_tokens, kv.host_hits, kv.stored_bytes)
        now = time.monotonic()
        if key == self._sent or (now - self._sent_at < MIN_INTERVAL_SECONDS and state.running and
                                 key[:2] == self._sent[:2]):
            return
        self._sent, self._sent_at = key, now
        self.outputs.put(EngineStats(EngineFigures(
            running=key[0], waiting=waiting, kv_tokens_per_worker=tokens,
            kv_tokens_cached_per_worker=kv.tokens_per_worker(cached=True),
            kv_capacity_per_worker=kv.capacity_per_worker, kv_pages_free=kv.free_pages(),
            num_preemptions=num_preemptions, num_recomputed_tokens=recomputed_tokens,
            prefix_cache_queries=key[4], prefix_cache_hits=key[5], prefix_cache_host_hits=kv.host_hits,
            kv_host_tokens_per_worker=kv.host_tokens_per_worker(),
            kv_host_capacity_per_worker=kv.host_capacity_per_worker, kv_host_evicted_tokens=kv.host_evicted_tokens,
            kv_offload_stored_bytes=kv.stored_bytes, kv_offload_restored_bytes=kv.restored_bytes)))

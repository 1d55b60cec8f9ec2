"""The messages on the engine's two queues, one dataclass each (matched by type, never by a tag string).

requests, the front (LLM) to worker 0's scheduler:
  AddRequest        a prompt to run
  AbortRequest      a request to stop; its KV cache is freed on every worker
  StopScheduler     the scheduler's loop ends (the workers shut down after it)
outputs, the workers to the front:
  WorkerReady       a worker started; its facts (ModelRunner.info)
  WorkerFailed      a worker's exception, before it exits (never a silent hang)
  Tokens            sampled tokens: one, or a whole decode step's in one message (one pickle a step)
  EngineStats       the scheduler's gauges and counters (EngineFigures: LLM.stats, server/metrics.py)
"""
from dataclasses import dataclass, field

from burstserve.engine.outputs import Request, StepOutput


@dataclass(frozen=True)
class AddRequest:
    request: Request


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class StopScheduler:
    pass


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    info: dict


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    error: str           # "TypeName: message"
    trace: str = ""      # the formatted traceback

    def describe(self) -> str:
        return f"worker {self.rank} failed: {self.error}"


@dataclass(frozen=True)
class Tokens:
    items: list[StepOutput] = field(default_factory=list)


@dataclass(frozen=True)
class EngineFigures:
    """Worker 0's scheduler figures: gauges (now) and counters (since start). Per-worker lists are by rank."""
    running: int = 0                          # sequences decoding
    waiting: int = 0                          # waiting, preempted, and the prompt prefilled in chunks
    kv_tokens_per_worker: list = field(default_factory=list)          # in use (prefix-cache entries count as free)
    kv_tokens_cached_per_worker: list = field(default_factory=list)   # held by prefix-cache entries
    kv_capacity_per_worker: int = 0
    kv_pages_free: list = field(default_factory=list)
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0            # prefilled again after preemptions (cache hits not)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_host_hits: int = 0           # tokens restored from the KV host tier
    kv_host_tokens_per_worker: list = field(default_factory=list)
    kv_host_capacity_per_worker: int = 0      # 0: no host tier
    kv_host_evicted_tokens: int = 0
    kv_offload_stored_bytes: int = 0
    kv_offload_restored_bytes: int = 0


@dataclass(frozen=True)
class EngineStats:
    figures: EngineFigures

"""The messages on the engine's two queues, one dataclass each (matched by type, never by a tag string).

requests, the front (LLM) to worker 0's scheduler:
  AddRequest        a prompt to run
  AbortRequest      a request to stop; its KV cache is freed on every worker
  StopScheduler     the scheduler's loop ends (the workers shut down after it)
outputs, the workers to the front:
  WorkerReady       a worker started; its facts (WorkerFacts: ModelRunner.facts)
  WorkerFailed      a worker's exception, before it exits (never a silent hang)
  Tokens            sampled tokens: one, or a whole decode step's in one message (one pickle a step)
  EngineStats       the scheduler's gauges and counters (EngineFigures: LLM.stats, server/metrics.py)
"""
from dataclasses import dataclass, field

from burstserve.engine.core.outputs import Request, StepOutput
from burstserve.engine.core.placement import PromptPlacement


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
class WorkerFacts:
    """What a started worker reports of itself: the front's checks (engine/llm.py) and worker 0's scheduler
    (its KV manager, chunk sizer and policy) are built from these and the engine's options, never from a
    runner object. Every worker reports the same but for rank and device."""
    rank: int
    device: str                      # torch.device's name: "cuda:0", "cpu"
    kernel: str                      # the attention backend's name
    block_size: int                  # tokens a KV page holds
    kv_pages_per_worker: int
    placement: PromptPlacement       # how the strategy places a prompt's K/V over the workers (its kv_workers)
    max_pages_per_seq: int           # the pages one sequence may hold on a worker (the block table's width)
    kv_cache_dtype: str              # "bfloat16", "float32", "fp8"
    kv_host_pages: int               # the host tier's pages per worker (0: no tier)
    cuda_graphs: bool                # decode steps replayed as CUDA graphs
    mixed_graph_tokens: int          # the largest chunk replayed with a decode step as one CUDA graph (0: none)
    zero_sliced_max_tokens: int | None = None   # burst-zero: the longest prompt run on the weight slices
    prefill_rows_max: int | None = None         # activations reserved for this many prompt tokens (None: any)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens this worker's pages hold."""
        return self.kv_pages_per_worker * self.block_size

    @property
    def kv_capacity_total(self) -> int:
        """Tokens the engine's pages hold, one sequence's K/V spread over the placement's kv_workers."""
        return self.kv_capacity_tokens * self.placement.kv_workers

    @property
    def kv_host_capacity_tokens(self) -> int:
        return self.kv_host_pages * self.block_size


@dataclass(frozen=True)
class HostProgress:
    """Worker 0's host tier after a call (engine/pages/host_pool.py): the copies still running, what the KV
    manager plans with (an entry still being stored is evicted last; a prompt still restoring waits while others
    decode). Every worker copies alike, so worker 0's view is every worker's. Asynchronous: copies run beside
    compute (CUDA); on CPU they are done when their call returns and nothing is ever pending."""
    asynchronous: bool = False
    loading: frozenset = frozenset()     # seq ids whose restore from the tier is still copying
    storing: frozenset = frozenset()     # seq ids whose store to the tier is queued or still copying
    queued: int = 0                      # store layers not issued yet


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    facts: WorkerFacts


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

"""What worker 0 asks of every worker, one message type per call, and what each call returns.

Worker 0's scheduler builds a call (`Prefill(seq_id, token_ids)`) while it plans a turn and its KV manager
places it (where its tokens go over the workers: engine/cache/kv_manager.py `place`, the only keeper of that
ledger; a cache change carries the tokens by worker it copies or keeps); `call(message)`
(engine/scheduler/dispatch.py) runs it on worker 0 and sends every other worker the same calls in the same
order, one Turn message a scheduler turn over the control plane (engine/control.py). Every worker runs a call
through its one entry point, ModelRunner.execute (engine/runner/model_runner.py: one handler per type, on the
runner or for the cache's calls on its WorkerCache, engine/runner/worker_cache.py). A handler
returns its result type on worker 0; elsewhere the result is dropped, so what only worker 0 needs (the
logits, the sampled tokens) is filled on worker 0 alone.
"""
from dataclasses import dataclass, field, fields

import torch

from burstserve.engine.core.outputs import PrefillStats
from burstserve.engine.core.placement import ExtendWay, Shard
from burstserve.engine.core.sampling import RowSampling


# ---------------------------------------------------------------- calls

@dataclass
class SampleNext:
    """What worker 0 returns after a prompt's last token (a request's first token, a resumed sequence's next):
    the token drawn on its device by `rule`, as a decode step's rows are drawn (engine/runner/step_tokens.py),
    with its logprobs where the rule asks. The logits [V] come back to the host instead of the token for a
    grammar's row (`on_host`: masked and drawn there), or beside it (`logits`: a request's first token, whose
    logits a twin admitted while it runs draws from; LLM.next_token_logits returns them)."""
    rule: RowSampling
    on_host: bool = False
    logits: bool = False


@dataclass
class Prefill:
    """A prompt's first prefill by the engine's strategy: its K/V into every worker's pages."""
    seq_id: int
    token_ids: torch.Tensor                    # [N] int64, CPU
    prompt_logprobs: int | None = None         # top k of every prompt position, or None
    pages: list[list[int]] | None = None       # by rank, the pages its prompt fills (set by the KV manager's `place`)
    sample_next: SampleNext | None = None      # its last token's next (None: a chunk before the last; nothing back)


@dataclass
class ExtendPlacement:
    """Where an extend's new tokens go over the workers, as the KV manager placed them."""
    way: ExtendWay
    shards: list[Shard]                        # the new tokens over the workers, by rank
    held: list[int]                            # the sequence's tokens on each worker before them, by rank
    pages: list[list[int]]                     # by rank, the pages each worker takes for them


@dataclass
class Extend:
    """An incremental prefill: tokens start .. start+n-1 after the `start` already cached (a chunk of a
    chunked prefill, or a prompt past its cached prefix)."""
    seq_id: int
    token_ids: torch.Tensor                    # [n] int64, CPU
    start: int
    placed: ExtendPlacement | None = None      # set by the KV manager's `place`
    sample_next: SampleNext | None = None      # as Prefill's


@dataclass
class Decode:
    """One new token for each sequence. With `fed_from` (asynchronous scheduling, engine/runner/step_tokens.py)
    row i's input token is row fed_from[i]'s sampled token of the step before, on the device (token_ids
    then unused)."""
    seq_ids: list[int]
    token_ids: list[int]
    positions: list[int]
    sampling: "list | None" = None             # per row its RowSampling (engine/core/sampling.py); None: greedy
    host_rows: list[int] = field(default_factory=list)   # rows sampled on the host (grammars): their logits back
    fed_from: list[int] | None = None
    owners: list[list[int]] | None = None      # per row the workers that store its new token (the KV manager's)
    new_pages: list[list[int]] | None = None   # per row, the page each of those workers takes for it (0: none)


@dataclass
class DecodeAhead(Decode):
    """A decode step whose tokens stay on the device for the next step (asynchronous scheduling): worker 0
    gets PendingTokens at once, read back later. No host rows."""


@dataclass
class ExtendAndDecode:
    """A chunk (as Extend) and one decode step of other sequences (as Decode) in one forward pass."""
    extend: Extend
    decode: Decode


@dataclass
class Fork:
    """seq_id's cache starts as a copy of source_id's prompt K/V (`counts` of its tokens on each worker)."""
    source_id: int
    seq_id: int
    counts: list[int]
    pages: list[list[int]] | None = None       # by rank, the pages of seq_id's copy (the KV manager's)


@dataclass
class Adopt:
    """seq_id's cache starts as a copy of source_id's tokens before `position` (a cached prefix; `counts` of
    them on each worker, each worker's first slots of the source)."""
    source_id: int
    seq_id: int
    position: int
    counts: list[int]
    pages: list[list[int]] | None = None       # by rank, the pages of seq_id's copy (the KV manager's)


@dataclass
class Truncate:
    """A prefix-cache entry keeps only its tokens before `position` (`kept` of them on each worker)."""
    seq_id: int
    position: int
    kept: list[int]


@dataclass
class Retire:
    """These sequences stop decoding and stay in the cache (prefix-cache entries)."""
    seq_ids: list[int]


@dataclass
class Reinstate:
    """Retired sequences decode again on the pages they kept."""
    seq_ids: list[int]


@dataclass
class Free:
    seq_ids: list[int]


@dataclass
class Offload:
    """A copy of the sequence's tokens before `position` into the host tier (engine/pages/host_pool.py), as
    the host entry of its id (write-through: the sequence has just retired into a prefix-cache entry).
    Returns the bytes copied (on worker 0)."""
    seq_id: int
    position: int
    counts: list[int]                          # its tokens before `position` on each worker
    pages: list[list[int]] | None = None       # by rank, the host tier's pages of the copy (the KV manager's)


@dataclass
class Restore:
    """seq_id's cache starts as a copy of host entry host_id's tokens before `position` (a cached prefix
    held in host memory). Returns the bytes copied (on worker 0)."""
    host_id: int
    seq_id: int
    position: int
    counts: list[int]                          # the entry's tokens before `position` on each worker
    pages: list[list[int]] | None = None       # by rank, the pages of seq_id's copy (the KV manager's)


@dataclass
class HostFree:
    """These host entries are dropped (host ids)."""
    host_ids: list[int]


@dataclass
class PumpStores:
    """The engine is idle: the next slice of the stores to the host tier still queued is issued
    (engine/pages/host_pool.py)."""


@dataclass
class Shutdown:
    """The workers leave their loop."""


# The calls that change the cache's bookkeeping and copy pages, none of them a collective: worker 0 runs them
# when the scheduler makes them, the other workers with the turn's next message (engine/scheduler/dispatch.py).
CACHE_CHANGES = (Fork, Adopt, Truncate, Retire, Reinstate, Free, Offload, Restore, HostFree)


@dataclass
class Turn:
    """What the other workers run for one turn of worker 0's scheduler, in order: the cache's changes worker 0
    made since the last Turn, then the turn's work (None: only the changes; Shutdown: then they leave)."""
    changes: list
    work: object | None


# ---------------------------------------------------------------- results (on worker 0)

@dataclass
class DecodeResult:
    tokens: list[int]                          # every row's token
    host_logits: torch.Tensor                  # [len(host_rows), V] fp32, CPU
    logprobs: list | None = None               # per row its logprobs entry where sampling asked, else None


@dataclass
class PrefillResult:
    """What a Prefill or an Extend (or ExtendAndDecode's chunk) returns: its timings, and on worker 0 what its
    SampleNext asks (the next token, the last token's logits). `stats()` is what a request's metrics report (engine/core/outputs.py PrefillStats)."""
    prefill_seconds: float
    strategy: str                              # the strategy's name; "extend" or "extend+decode" for a chunk
    setup_seconds: float | None = None
    wrapup_seconds: float | None = None
    cached_tokens: int | None = None           # an extend: the tokens before its own
    restore_seconds: float | None = None       # an extend after a restore from the host tier: the copy's time
    restored_bytes: int | None = None          # ... and its bytes (this worker's)
    exposed_seconds: float | None = None       # the ring's exchanges: compute stalled waiting for them
    exchange_overlapped_seconds: float | None = None
    exchange_seconds: float | None = None      # all layers' exchanges alone (arithmetic)
    hidden_fraction: float | None = None
    peak_memory_bytes: int | None = None
    extend_way: ExtendWay | None = None        # an extend: how it ran
    graphed: bool = False                      # an extend replayed as a CUDA graph
    token: int | None = None                   # the next token, drawn as the call's SampleNext says (worker 0)
    logprobs: dict | None = None               # ... its logprobs entry, where its rule asks
    logits: torch.Tensor | None = None         # [V] fp32, CPU (worker 0), where its SampleNext asks
    prompt_logprobs: list | None = None        # (worker 0, when asked)
    decode: DecodeResult | None = None         # ExtendAndDecode: the decode step's (worker 0)

    def stats(self) -> PrefillStats:
        """Its figures as a request reports them (the fields PrefillStats has)."""
        return PrefillStats(**{f.name: getattr(self, f.name) for f in fields(PrefillStats) if hasattr(self, f.name)})

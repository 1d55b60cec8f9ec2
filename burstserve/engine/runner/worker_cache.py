"""A worker's side of the KV cache: its pages (PagePool) and the host-memory tier under the prefix cache
(--kv-offload-gb). Where tokens go over the workers is decided by the scheduler's KV manager
(engine/cache/kv_manager.py, the one ledger) and arrives with each call: a step's tokens are stored here
where the call says (a prompt by the strategy's shards, a chunk by its ExtendPlacement, a decode token on
the workers a row names), on the pages the call names, and the cache calls of engine/core/calls.py (fork, adopt,
offload, restore, retire, truncate, reinstate, free, host_free) are its methods, each with its counts and pages
by worker. The pools check that every page they are given is free (engine/pages/page_pool.py HeldPages)."""
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from burstserve.engine.cache.ledger import pages_for
from burstserve.engine.core.calls import (Adopt, Decode, ExtendPlacement, Fork, Free, HostFree, Offload, PrefillResult,
                                     PumpStores, Reinstate, Restore, Retire, Truncate)
from burstserve.engine.core.errors import ModelLoadError
from burstserve.engine.core.messages import HostProgress
from burstserve.engine.core.placement import ExtendWay, Shard
from burstserve.engine.model.config import EngineConfig, ModelConfig
from burstserve.engine.pages.host_pool import STORE_IN_FLIGHT, HostPool
from burstserve.engine.pages.page_pool import PagePool
from burstserve.engine.pages.sizing import kv_bytes_per_token
from burstserve.engine.runner.worker_memory import PoolSize, size_pool

log = logging.getLogger(__name__)


@dataclass
class PlacedExtend:
    """Where an incremental prefill's new tokens went (WorkerCache.place_extend), on this worker."""
    way: ExtendWay                # LOCAL, WHOLE or RING (engine/runner/extend_attention.py)
    shards: list                  # the new tokens over the workers (Shard, positions within the new tokens)
    positions: torch.Tensor       # [m] int64 (host): the rows this worker runs, within the new tokens
    cached: int                   # the sequence's tokens on this worker before them
    cached_all: list[int]         # ... on every worker, by rank
    host_slots: torch.Tensor      # [n_w] int64 (host): where this worker keeps new K/V (n_w = its shard's length)
    keeps: bool                   # it keeps some of them

    @property
    def shards_tokens(self) -> int:
        return sum(s.length for s in self.shards)


class AfterRestore:
    """An extend's attention whose layer i first makes the compute stream wait for layer i's copies of a
    restore from the host tier (engine/pages/host_pool.py): the copy of later layers hides under the compute
    of earlier ones. Otherwise the attention it wraps (its attributes too)."""

    def __init__(self, attend, layer_waits: list):
        self.attend, self.layer_waits = attend, layer_waits

    def __call__(self, layer: int, q, k, v):
        torch.cuda.current_stream().wait_event(self.layer_waits[layer])
        return self.attend(layer, q, k, v)

    def __getattr__(self, name):
        return getattr(self.attend, name)


class WorkerCache:
    def __init__(self, pool: PagePool, strategy, rank: int, host: HostPool | None = None):
        self.pool, self.strategy, self.rank, self.host = pool, strategy, rank, host

    @classmethod
    def build(cls, engine: EngineConfig, cfg: ModelConfig, num_kv_heads: int, dtype: torch.dtype, strategy, layout,
              device: torch.device, rank: int, data_group, max_model_len: int) -> "tuple[WorkerCache, PoolSize]":
        """A worker's cache at start, after its weights: the pool sized from what memory is left (the same
        number of pages on every worker: collective) and the host tier -> (it, the sizing)."""
        size = size_pool(engine, cfg, num_kv_heads, dtype, strategy, layout, device, rank, data_group, max_model_len)
        share = strategy.kv_share(max_model_len)             # a worker's share of the longest sequence
        pool = PagePool(cfg.num_layers, size.pages, engine.page_size, num_kv_heads, cfg.head_dim, dtype, device,
                        max_seqs=engine.max_num_seqs + 1,
                        max_pages_per_seq=min(size.pages, pages_for(share, engine.page_size)),
                        kv_cache_dtype=engine.kv_cache_dtype, placed=True)
        host = host_tier(engine, cfg, num_kv_heads, dtype.itemsize, pool, rank, device, data_group)   # or None
        return cls(pool, strategy, rank, host), size

    # ------------------------------------------------------------ placing a step's tokens

    def place_prompt(self, seq_id: int, shards: list[Shard], pages: list[list[int]]) -> tuple[Shard, torch.Tensor]:
        """A prompt's first prefill over `shards`, on the pages the KV manager gave each worker -> (this worker's
        Shard, its slots [n] int64)."""
        shard = self.strategy.shard_of(shards, self.rank)
        self.pool.add(seq_id, shard.length, pages[self.rank])
        return shard, self.pool.slots(seq_id, 0, shard.length)

    def place_extend(self, seq_id: int, num_tokens: int, placed: ExtendPlacement) -> PlacedExtend:
        """num_tokens new tokens of the sequence, placed over the workers by the KV manager: this worker's rows
        and pages."""
        way, shards = placed.way, placed.shards
        shard = self.strategy.shard_of(shards, self.rank)
        positions = torch.arange(num_tokens) if way == ExtendWay.WHOLE else shard.positions()   # [m], of the new tokens
        host_slots = self.pool.extend(seq_id, shard.length, placed.pages[self.rank])   # [n_w]: the K/V kept here
        return PlacedExtend(way, shards, positions, placed.held[self.rank], list(placed.held), host_slots,
                            keeps=shard.length > 0)

    def place_decode_tokens(self, step: Decode) -> torch.Tensor:
        """This worker's pages take one token per sequence where the step (placed by the KV manager) names it
        among the row's owners, on the new page it names for it -> [5, B] int64: tokens, positions, slots
        (scratch where another worker stores the token), keys held here, table rows."""
        slots, lens, rows = [], [], []
        for s, stores, pages in zip(step.seq_ids, step.owners, step.new_pages):
            if self.rank in stores:
                slots.append(self.pool.append(s, pages[stores.index(self.rank)]))
            else:
                slots.append(0)                                             # page 0: scratch
            lens.append(self.pool.lengths[s])
            rows.append(self.pool.rows[s])
        return torch.tensor([step.token_ids, step.positions, slots, lens, rows], dtype=torch.int64)

    # ------------------------------------------------------------ the cache calls

    @torch.inference_mode()
    def fork(self, call: Fork) -> None:
        """A new sequence whose cache starts as a copy of the source's prompt K/V (the prompt's tokens
        fill each worker's first slots; what the source decoded since is not copied)."""
        self.pool.copy_prefix(call.source_id, call.seq_id, call.counts[self.rank], call.pages[self.rank])

    @torch.inference_mode()
    def adopt(self, call: Adopt) -> None:
        """A new sequence whose cache starts as a copy of the source's tokens before `position` (a
        cached prefix: on every worker, the source's first slots there, whole pages copied)."""
        self.pool.copy_prefix(call.source_id, call.seq_id, call.counts[self.rank], call.pages[self.rank])

    @torch.inference_mode()
    def offload(self, call: Offload) -> int:
        """A host entry of the sequence's id: a copy of its tokens before `position` (every worker its own
        first slots) -> the bytes this worker copies."""
        return self.host.store(self.pool, call.seq_id, call.seq_id, call.counts[self.rank], call.pages[self.rank])

    @torch.inference_mode()
    def restore(self, call: Restore) -> int:
        """A new sequence whose cache starts as a copy of the host entry's tokens before `position` (on every
        worker, the entry's first slots there, whole pages copied) -> the bytes this worker copies."""
        count = call.counts[self.rank]
        self.pool.add(call.seq_id, count, call.pages[self.rank])
        return self.host.load(self.pool, call.host_id, call.seq_id, count)

    def pump_stores(self) -> None:
        """Issues the next STORE_IN_FLIGHT bytes of the host tier's queued stores (before every call)."""
        if self.host is not None and self.host.queued:
            self.host.pump(STORE_IN_FLIGHT)

    def host_progress(self) -> HostProgress:
        """The host tier's copies still running (engine/core/messages.py), reported after every call on worker 0."""
        return self.host.progress() if self.host is not None else HostProgress()

    def pump_idle(self, call: PumpStores) -> None:
        """The engine is idle: the next slice of the queued stores (pump_stores, which every call runs first)."""
        self.pump_stores()

    def host_free(self, call: HostFree) -> None:
        for h in call.host_ids:
            self.host.free(h)

    def retire(self, call: Retire) -> None:
        """These sequences stop decoding and stay in the cache (prefix-cache entries: copied from, freed later)."""
        for s in call.seq_ids:
            self.pool.retire(s)

    def truncate(self, call: Truncate) -> None:
        """A prefix-cache entry keeps only its tokens before `position` (its tail's pages freed on every worker)."""
        self._pages_unused(call.seq_id)
        self.pool.truncate(call.seq_id, call.kept[self.rank])

    def reinstate(self, call: Reinstate) -> None:
        """Retired sequences decode again on the pages they kept (a preempted sequence's entry taken back)."""
        for s in call.seq_ids:
            self.pool.reinstate(s)

    def free(self, call: Free) -> None:
        for s in call.seq_ids:
            self._pages_unused(s)
            self.pool.free(s)

    # ------------------------------------------------------------ the host tier around a step

    def restore_waits(self, seq_id: int) -> list | None:
        """The layer events of a restore of this sequence still copying from the host tier, or None."""
        return self.host.layer_waits(seq_id) if self.host is not None else None

    @staticmethod
    def wait_restore(waits: list | None) -> None:
        """The compute stream waits for the whole of a restore still copying (a graph replays every layer)."""
        if waits:
            torch.cuda.current_stream().wait_event(waits[-1])

    def with_restore(self, seq_id: int, result: PrefillResult) -> PrefillResult:
        """An extend's result, with the restore from the host tier that preceded it (its copy's seconds and bytes)."""
        done = self.host.restore_seconds(seq_id) if self.host is not None else None
        if done is not None:
            result.restore_seconds, result.restored_bytes = done
        return result

    def release_host_tier(self) -> None:
        """Unpins the host tier's memory (at shutdown)."""
        if self.host is not None:
            self.host.release()
            self.host = None

    def _pages_unused(self, seq_id: int) -> None:
        """Before the sequence's pages go back to the pool: the compute stream waits for the host tier's copies
        out of them or into them (whoever takes them next writes them)."""
        if self.host is not None:
            self.host.pages_unused(seq_id)


def host_tier(engine: EngineConfig, cfg: ModelConfig, num_kv_heads: int, itemsize: int, pool: PagePool, rank: int,
              device: torch.device, data_group) -> HostPool | None:
    """The host-memory tier under the prefix cache: --kv-offload-gb GiB of pages shaped like the pool's (the
    fewest over the workers, so every worker's tier is the same size); None at 0."""
    gib = engine.kv_offload_gb
    if not gib:
        return None
    page_bytes = engine.page_size * kv_bytes_per_token(cfg, num_kv_heads, itemsize, engine.kv_cache_dtype)
    agreed = torch.tensor([int(gib * 2**30) // page_bytes], dtype=torch.int64, device=device)
    if engine.world_size > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=data_group)
    pages = int(agreed)
    if pages < 1:
        raise ModelLoadError(f"--kv-offload-gb {gib} holds no KV page (a page is {page_bytes / 2**20:.1f} MiB "
                             f"on a worker): raise it, or 0 for no host tier")
    start = time.perf_counter()
    host = HostPool(pool, pages, placed=True)
    log.info("worker %d: KV host tier of %d pages x %d tokens (%.2f GiB%s, %.1f s)", rank, pages,
             engine.page_size, host.bytes() / 2**30, ", pinned" if host.cuda else "", time.perf_counter() - start)
    return host

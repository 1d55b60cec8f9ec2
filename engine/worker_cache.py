"""A worker's side of the KV cache: its pages (PagePool), the ledger of which worker holds which tokens (the
same on every worker), the planner of where new tokens go, and the host-memory tier under the prefix cache
(--kv-offload-gb). A step's tokens are placed here before its forward runs (a prompt, a chunk, a decode
token per sequence), and the cache calls of engine/calls.py (fork, adopt, offload, restore, retire,
truncate, reinstate, free, host_free) are its methods. Every worker places alike: their ledgers agree."""
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.cache.host_pool import STORE_IN_FLIGHT, HostPool
from engine.cache.ledger import KVLedger, pages_for
from engine.cache.page_planner import ExtendWay, PagePlanner
from engine.cache.page_pool import PagePool
from engine.cache.sizing import kv_bytes_per_token
from engine.calls import (Adopt, Fork, Free, HostFree, Offload, PrefillResult, PumpStores, Reinstate, Restore, Retire,
                          Truncate)
from engine.config import EngineConfig, ModelConfig
from engine.errors import ModelLoadError
from engine.parallel.sharding import Shard
from engine.worker_memory import PoolSize, size_pool

log = logging.getLogger(__name__)


@dataclass
class PlacedExtend:
    """Where an incremental prefill's new tokens went (WorkerCache.place_extend), on this worker."""
    way: ExtendWay                # LOCAL, WHOLE or RING (engine/extend_attention.py)
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
    restore from the host tier (engine/cache/host_pool.py): the copy of later layers hides under the compute
    of earlier ones. Otherwise the attention it wraps (its attributes too)."""

    def __init__(self, attend, layer_waits: list):
        self.attend, self.layer_waits = attend, layer_waits

    def __call__(self, layer: int, q, k, v):
        torch.cuda.current_stream().wait_event(self.layer_waits[layer])
        return self.attend(layer, q, k, v)

    def __getattr__(self, name):
        return getattr(self.attend, name)


class WorkerCache:
    def __init__(self, pool: PagePool, ledger: KVLedger, pages: PagePlanner, strategy, rank: int,
                 host_ledger: KVLedger | None = None, host: HostPool | None = None):
        self.pool, self.ledger, self.pages, self.strategy, self.rank = pool, ledger, pages, strategy, rank
        self.host_ledger, self.host = host_ledger, host

    @classmethod
    def build(cls, engine: EngineConfig, cfg: ModelConfig, num_kv_heads: int, dtype: torch.dtype, strategy, layout,
              device: torch.device, rank: int, data_group, max_model_len: int) -> "tuple[WorkerCache, PoolSize]":
        """A worker's cache at start, after its weights: the pool sized from what memory is left (the same
        number of pages on every worker: collective), its ledger and planner, the host tier -> (it, the sizing)."""
        size = size_pool(engine, cfg, num_kv_heads, dtype, strategy, layout, device, rank, data_group, max_model_len)
        share = strategy.kv_share(max_model_len)             # a worker's share of the longest sequence
        pool = PagePool(cfg.num_layers, size.pages, engine.page_size, num_kv_heads, cfg.head_dim, dtype, device,
                        max_seqs=engine.max_num_seqs + 1,
                        max_pages_per_seq=min(size.pages, pages_for(share, engine.page_size)),
                        kv_cache_dtype=engine.kv_cache_dtype)
        ledger = KVLedger(engine.world_size, engine.page_size, size.pages, replicated=strategy.replicated_kv)
        pages = PagePlanner(strategy, ledger, pool.max_pages_per_seq, engine.extend_ring_min_tokens)
        host = host_tier(engine, cfg, num_kv_heads, dtype.itemsize, pool, rank, device, data_group,
                         strategy.replicated_kv)   # --kv-offload-gb (engine/cache/host_pool.py), or (None, None)
        return cls(pool, ledger, pages, strategy, rank, *host), size

    # ------------------------------------------------------------ placing a step's tokens

    def place_prompt(self, seq_id: int, shards: list[Shard]) -> tuple[Shard, torch.Tensor]:
        """A prompt's first prefill over `shards` -> (this worker's Shard, its slots [n] int64)."""
        shard = self.strategy.shard_of(shards, self.rank)
        self.ledger.add(seq_id, self.pages.tokens_per_rank(shards), self.pages.ranges(shards, 0))
        self.pool.add(seq_id, shard.length)
        return shard, self.pool.slots(seq_id, 0, shard.length)

    def place_extend(self, seq_id: int, num_tokens: int, start: int, reserved: list[int] | None = None) -> PlacedExtend:
        """num_tokens new tokens after the sequence's `start` cached ones: their way, the ledger, this worker's
        pages. reserved: pages per worker a decode step in the same call takes (see PagePlanner.extend_way)."""
        held = self.ledger.seqs[seq_id].tokens
        way = self.pages.extend_way(num_tokens, held, reserved)
        shards = self.pages.extend_shards(held, num_tokens, way)
        shard = self.strategy.shard_of(shards, self.rank)
        positions = torch.arange(num_tokens) if way == ExtendWay.WHOLE else shard.positions()   # [m], of the new tokens
        cached, cached_all = self.ledger.tokens(seq_id, self.rank), list(held)
        self.ledger.extend(seq_id, self.pages.tokens_per_rank(shards), self.pages.ranges(shards, start))
        host_slots = self.pool.extend(seq_id, shard.length)             # [n_w]: the K/V this worker keeps
        return PlacedExtend(way, shards, positions, cached, cached_all, host_slots, keeps=shard.length > 0)

    def place_decode_tokens(self, seq_ids: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Advances the ledger and this worker's pages by one token per sequence -> [5, B] int64: tokens,
        positions, slots (scratch where another worker stores the token), keys held here, table rows."""
        slots, lens, rows = [], [], []
        for s in seq_ids:
            if self.rank in self.ledger.advance(s):
                slots.append(self.pool.append(s))
            else:
                slots.append(0)                                             # page 0: scratch
            lens.append(self.pool.lengths[s])
            rows.append(self.pool.rows[s])
        return torch.tensor([token_ids, positions, slots, lens, rows], dtype=torch.int64)

    # ------------------------------------------------------------ the cache calls

    @torch.inference_mode()
    def fork(self, call: Fork) -> None:
        """A new sequence whose cache starts as a copy of the source's prompt K/V (the prompt's tokens
        fill each worker's first slots; what the source decoded since is not copied)."""
        source_id, seq_id = call.source_id, call.seq_id
        counts = self.ledger.prompt_tokens(source_id)
        self.ledger.add(seq_id, counts, self.ledger.prompt_ranges(source_id))
        self.pool.copy_prefix(source_id, seq_id, counts[self.rank])

    @torch.inference_mode()
    def adopt(self, call: Adopt) -> None:
        """A new sequence whose cache starts as a copy of the source's tokens before `position` (a
        cached prefix: on every worker, the source's first slots there, whole pages copied)."""
        counts = self.ledger.add_prefix_of(call.source_id, call.seq_id, call.position)
        self.pool.copy_prefix(call.source_id, call.seq_id, counts[self.rank])

    @torch.inference_mode()
    def offload(self, call: Offload) -> int:
        """A host entry of the sequence's id: a copy of its tokens before `position` (every worker its own
        first slots) -> the bytes this worker copies."""
        counts = self.host_ledger.add_prefix_of(call.seq_id, call.seq_id, call.position, tier=self.ledger)
        return self.host.store(self.pool, call.seq_id, call.seq_id, counts[self.rank])

    @torch.inference_mode()
    def restore(self, call: Restore) -> int:
        """A new sequence whose cache starts as a copy of the host entry's tokens before `position` (on every
        worker, the entry's first slots there, whole pages copied) -> the bytes this worker copies."""
        counts = self.ledger.add_prefix_of(call.host_id, call.seq_id, call.position, tier=self.host_ledger)
        self.pool.add(call.seq_id, counts[self.rank])
        return self.host.load(self.pool, call.host_id, call.seq_id, counts[self.rank])

    def pump_stores(self) -> None:
        """Issues the next STORE_IN_FLIGHT bytes of the host tier's queued stores (before every call)."""
        if self.host is not None and self.host.queued:
            self.host.pump(STORE_IN_FLIGHT)

    def pump_idle(self, call: PumpStores) -> None:
        """The engine is idle: the next slice of the queued stores (pump_stores, which every call runs first)."""
        self.pump_stores()

    def host_free(self, call: HostFree) -> None:
        for h in call.host_ids:
            self.host.free(h)
            self.host_ledger.remove(h)

    def retire(self, call: Retire) -> None:
        """These sequences stop decoding and stay in the cache (prefix-cache entries: copied from, freed later)."""
        for s in call.seq_ids:
            self.pool.retire(s)

    def truncate(self, call: Truncate) -> None:
        """A prefix-cache entry keeps only its tokens before `position` (its tail's pages freed on every worker)."""
        self._pages_unused(call.seq_id)
        self.pool.truncate(call.seq_id, self.ledger.truncate(call.seq_id, call.position)[self.rank])

    def reinstate(self, call: Reinstate) -> None:
        """Retired sequences decode again on the pages they kept (a preempted sequence's entry taken back)."""
        for s in call.seq_ids:
            self.pool.reinstate(s)

    def free(self, call: Free) -> None:
        for s in call.seq_ids:
            self._pages_unused(s)
            self.pool.free(s)
            self.ledger.remove(s)

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
              device: torch.device, data_group, replicated: bool) -> tuple[KVLedger | None, HostPool | None]:
    """The host-memory tier under the prefix cache: --kv-offload-gb GiB of pages shaped like the pool's (the
    fewest over the workers, so every worker's tier is the same size), and its ledger; (None, None) at 0."""
    gib = engine.kv_offload_gb
    if not gib:
        return None, None
    page_bytes = engine.page_size * kv_bytes_per_token(cfg, num_kv_heads, itemsize, engine.kv_cache_dtype)
    agreed = torch.tensor([int(gib * 2**30) // page_bytes], dtype=torch.int64, device=device)
    if engine.world_size > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=data_group)
    pages = int(agreed)
    if pages < 1:
        raise ModelLoadError(f"--kv-offload-gb {gib} holds no KV page (a page is {page_bytes / 2**20:.1f} MiB "
                             f"on a worker): raise it, or 0 for no host tier")
    start = time.perf_counter()
    host = HostPool(pool, pages)
    log.info("worker %d: KV host tier of %d pages x %d tokens (%.2f GiB%s, %.1f s)", rank, pages,
             engine.page_size, host.bytes() / 2**30, ", pinned" if host.cuda else "", time.perf_counter() - start)
    return KVLedger(engine.world_size, engine.page_size, pages, replicated=replicated), host

"""A sharded extend's attention by passing K/V (pass-KV, Meta's arXiv 2411.01783): the new tokens' queries see
the cached tokens and each other through one ring, as a prompt's do in a prefill.

Each worker's block is its cached K/V of the sequence followed by its shard of the new tokens' K/V
([c_r + n_r, 2, Hkv, D]); the blocks travel around the ring (engine/parallel/ring.py RingPass: double
buffered, the next block in flight while the current one is attended). A worker's new queries attend a
block's cached part in full (every cached token precedes every new one) and its new part by BurstAttention's
zigzag causal rule (engine/parallel/burst_attention.py); the partials merge into fp32 accumulators.

Against pass-Q (engine/runner/extend_attention.py, ExtendAttention._cached_partials_of_mine: every worker's queries
gathered to each worker's cache, the fp32 partials sent back by an all-to-all, neither overlapped) a cached
token travels as its K/V (4 KiB for llama3-8b's 8 KV heads in bf16) where a new token's query and partial
travel as ~24 KiB, and the exchange hides behind the block being attended. The cost is memory that grows
with the context: the worker's own block and the two ring buffers of the largest block (PassKVChoice:
only where that fits the reserve made for a chunk's pass-Q: `block_bytes`).
"""
import logging

import torch

from burstserve.engine.core.placement import ExtendWay, Shard
from burstserve.engine.parallel.burst_attention import BurstAttention
from burstserve.engine.parallel.ring import RingCommunicator, RingPass
from burstserve.kernels.attention import AttentionBackend
from burstserve.kernels.kv_quant import is_fp8
from burstserve.kernels.merge import merge_into

log = logging.getLogger(__name__)


def block_bytes(cached: list[int], new_shards: list[Shard], num_kv_heads: int, head_dim: int, itemsize: int,
                page_size: int) -> int:
    """What pass-KV holds at once for one layer: the worker's own block and the ring's two buffers, each up to
    the largest worker's cached + new tokens of K and V, and while the own block is filled, one of K or V of
    its cached pages gathered (ExtendAttention._pass_kv_block)."""
    largest = max(c + s.length for c, s in zip(cached, new_shards))
    pages = max(-(-c // page_size) for c in cached) * page_size
    return (3 * largest * 2 + pages) * num_kv_heads * head_dim * itemsize


class PassKVChoice:
    """Does a "ring" extend pass the cached K/V around the ring rather than its queries to them? With --extend-pass
    kv on bf16 pages, where the blocks fit what the pool left for a chunk's pass-Q (on a GPU; a CPU worker's
    memory is taken as used). The same answer on every worker (one placement)."""

    def __init__(self, engine, num_kv_heads: int, head_dim: int, itemsize: int, reserve_bytes: int,
                 device: torch.device, rank: int):
        self.asked = engine.extend_pass == "kv" and not is_fp8(engine.kv_cache_dtype)
        self.shape = (num_kv_heads, head_dim, itemsize, engine.page_size)
        self.reserve_bytes, self.on_gpu, self.rank = reserve_bytes, device.type == "cuda", rank
        self.logged = False

    def __call__(self, placed) -> bool:
        """placed: an extend's PlacedExtend (engine/runner/worker_cache.py)."""
        if placed.way != ExtendWay.RING or not self.asked:
            return False
        need = block_bytes(placed.cached_all, placed.shards, *self.shape)
        fits = not self.on_gpu or need <= self.reserve_bytes
        if not fits and not self.logged:
            self.logged = True
            log.info("worker %d: --extend-pass kv: an extend's K/V blocks (%.1f GiB) do not fit the %.1f GiB reserved "
                     "for a chunk's pass-Q (none without chunked prefill, --kv-cache-tokens or flash-attn-4): it "
                     "passes Q (logged once)", self.rank, need / 2**30, self.reserve_bytes / 2**30)
        return fits


class PassKVAttention:
    def __init__(self, ring: RingCommunicator, backend: AttentionBackend, new_shards: list[Shard],
                 cached: list[int], rank: int, scale: float, overlap: bool = True):
        """new_shards: the new tokens over the workers (zigzag, ExtendAttention's "ring" way); cached: the
        sequence's tokens each worker holds before them, by rank (the ledger's, the same on every worker)."""
        self.backend, self.scale, self.rank, self.cached = backend, scale, rank, cached
        self.new = BurstAttention(ring, backend, new_shards, rank, scale, overlap)      # the new keys' causal rule
        self.ring_pass = RingPass(ring, [c + s.length for c, s in zip(cached, new_shards)], rank, overlap)

    def forward(self, q: torch.Tensor, block: torch.Tensor, between=None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n_r, H, D]: this worker's new tokens' queries; block [c_r + n_r, 2, Hkv, D]: its cached K/V of the
        sequence, then its new tokens' -> out [n_r, H, D] in q's dtype, lse [n_r, H] fp32. between(): the
        caller's work queued behind the first exchange (engine/parallel/ring.py, RingPass)."""
        if q.shape[0] == 0:                 # no new tokens here: the blocks still pass through
            self.ring_pass.run(block, lambda source, block: None, between)
            return q.clone(), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        acc, pending = {}, []   # pending: this step's partials, merged at the start of the next (BurstAttention)

        def absorb_pending() -> None:
            for rows, out, lse in pending:
                if not acc:     # the first partial is the own block's: its cached part, or its new part (causal)
                    acc["out"], acc["lse"] = out.float(), lse.float().clone()   # every row (a causal block's diagonal)
                else:
                    merge_into(acc["out"][rows], acc["lse"][rows], out, lse)
            pending.clear()

        def attend(source: int, block: torch.Tensor) -> None:
            absorb_pending()
            cached = self.cached[source]
            if cached:
                pending.append((slice(None), *self.backend(q, block[:cached, 0], block[:cached, 1], False, self.scale)))
            if block.shape[0] > cached:
                pending.append(self.new.attend_block(q, block[cached:], source))

        self.ring_pass.run(block, attend, between)
        absorb_pending()
        return acc["out"].to(q.dtype), acc["lse"]


"""BurstAttention prefill (forward only) over zigzag shards.

Queries stay on their worker; K and V travel together (one [n, 2, Hkv, D] block) around the ring.
At each of the G steps a worker attends its queries to the block it holds with one local kernel
call returning (out, lse), merges into fp32 accumulators, and meanwhile the next block is already
in flight into the other of two buffers. With zigzag shards (worker r holds chunks r and 2G-1-r)
each step is one of:
  own block:          causal attention of all local queries to all local keys (square);
  block of rank s<r:  all local queries to the keys of s's first chunk (full);
  block of rank s>r:  the queries of r's second chunk to all of s's keys (full).
Without a causal mask (causal=False) every step is all local queries to the whole block.
With an FP8 KV cache (fp8=True) K/V are already FP8 values (kernels/kv_quant.py), so the block travels as
FP8 bytes and a bf16 scale a row (`pack_kv`, [n, 2, Hkv, D + 2] uint8: (D + 2) / 2D of the bf16
block's bytes) and is turned back into the same values when attended: nothing changes but the bytes.
The strategies `burst` and `burst-nolao` (the same ring with a materialized-score local kernel:
the paper's ablation without its local attention optimization) are at the end.
"""
from functools import partial

import torch

from burstserve.engine.core.placement import Shard
from burstserve.engine.parallel.ring import RingCommunicator, RingPass
from burstserve.engine.parallel.strategy import Attention, PrefillContext, PrefillStrategy
from burstserve.kernels.attention import AttentionBackend, reference_attention
from burstserve.kernels.kv_quant import pack_kv, unpack_kv
from burstserve.kernels.merge import merge_into

MATERIALIZED = AttentionBackend("materialized", partial(reference_attention, query_chunk=1 << 62))


class BurstAttention:
    def __init__(self, ring: RingCommunicator | None, backend: AttentionBackend, shards: list[Shard],
                 rank: int, scale: float, overlap: bool = True, causal: bool = True, fp8: bool = False):
        self.backend, self.shards, self.rank = backend, shards, rank
        self.scale, self.causal, self.fp8 = scale, causal, fp8
        self.ring = ring
        self.ring_pass = RingPass(ring, [s.length for s in shards], rank, overlap)

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, between=None) -> torch.Tensor:
        """q [n, H, D], kv [n, 2, Hkv, D] (this worker's block) -> out [n, H, D] in q's dtype. between():
        the caller's work queued behind the first exchange (engine/parallel/ring.py, RingPass)."""
        return self.forward(q, kv, between)[0]

    def forward(self, q: torch.Tensor, kv: torch.Tensor, between=None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> out [n, H, D] in q's dtype, lse [n, H] fp32. Every merge is computed in fp32; the
        accumulator itself is fp32 only while two or more merges remain, so one worker returns its
        block's result as it is and two merge once straight into it (one rounding either way, as
        with an fp32 accumulator converted at the end).

        A step's partial is merged at the start of the next step, after that step's exchange is issued, so
        every later step has a kernel queued between its exchange and its attention (the merge; at step 1,
        from three workers, the accumulator's fp32 copy) as step 0 has the K/V store: RingPass says why the exchange needs one.
        Same merges in the same order; one partial is held a step longer."""
        acc, pending = {}, []
        merges_left = self.ring_pass.world_size - 1
        travels = pack_kv(kv) if self.fp8 and merges_left > 0 else kv                # the ring's message

        def absorb_pending() -> None:
            nonlocal merges_left
            if not pending:
                return
            rows, block_out, block_lse = pending.pop()
            if not acc:   # the first block is this worker's own: it covers every query row
                acc["out"] = block_out.float() if merges_left > 1 else block_out
                acc["lse"] = block_lse.clone()
                return
            merge_into(acc["out"][rows], acc["lse"][rows], block_out, block_lse)
            merges_left -= 1

        def attend(source: int, block: torch.Tensor) -> None:
            absorb_pending()
            if block is travels and travels is not kv:
                block = kv                                                           # its own: no round trip
            elif block.dtype == torch.uint8:
                block = unpack_kv(block, kv.dtype)                                  # [m, 2, Hkv, D]
            pending.append(self.attend_block(q, block, source))

        self.ring_pass.run(travels, attend, between)
        absorb_pending()
        return acc["out"].to(q.dtype), acc["lse"]

    def attend_block(self, q, block, source):
        """-> (query rows, out, lse) of this worker's queries against one worker's K/V block (`source`'s shard
        of the tokens this ring runs), by the zigzag causal rule."""
        k, v = block[:, 0], block[:, 1]                                  # [m, Hkv, D] each
        if not self.causal or source == self.rank:
            return slice(None), *self.backend(q, k, v, self.causal, self.scale)
        if source < self.rank:
            m = self.shards[source].len_first
            return slice(None), *self.backend(q, k[:m], v[:m], False, self.scale)
        m = self.shards[self.rank].len_first
        return slice(m, None), *self.backend(q[m:], k, v, False, self.scale)


class BurstStrategy(PrefillStrategy):
    """burst: BurstAttention over zigzag shards with the configured local kernel (the default)."""
    name = "burst"
    times_exchanges = True
    materialized = False   # burst-nolao: every step's scores [H, n, m] materialized (MATERIALIZED)

    def attention(self, ctx: PrefillContext, shards: list[Shard], rank: int) -> Attention:
        backend = MATERIALIZED if self.materialized else ctx.backend
        return BurstAttention(ctx.ring, backend, shards, rank, ctx.scale, ctx.overlap, fp8=ctx.kv_fp8)


class BurstNoLaoStrategy(BurstStrategy):
    name = "burst-nolao"
    materialized = True

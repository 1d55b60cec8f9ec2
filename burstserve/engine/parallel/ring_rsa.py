"""RingAttention as the BurstAttention paper benchmarks it (ring self-attention, Li et al. 2021).

K blocks go round first: every worker materializes its queries' full score rows [H, n, N] in fp32
and takes the softmax over the whole row; then V blocks go round and P V accumulates. K and V
travel in separate rounds, and the N/G x N score block exists in memory (this is what OOMs at long
prompts). Same zigzag shards and KV layout as `burst`, so decoding afterwards is the same.
"""
import torch

from burstserve.engine.core.placement import Shard
from burstserve.engine.parallel.ring import RingCommunicator, RingPass
from burstserve.engine.parallel.strategy import Attention, PrefillContext, PrefillStrategy


class RingSelfAttention:
    def __init__(self, ring: RingCommunicator | None, shards: list[Shard], rank: int, scale: float,
                 overlap: bool = True):
        self.shards, self.rank, self.scale = shards, rank, scale
        self.ring_pass = RingPass(ring, [s.length for s in shards], rank, overlap)
        self.columns = [0]                      # where each worker's keys sit in a score row
        for s in shards:
            self.columns.append(self.columns[-1] + s.length)

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, between) -> torch.Tensor:
        """q [n, H, D], kv [n, 2, Hkv, D] -> out [n, H, D] in q's dtype; between() behind the first exchange."""
        n, h, d = q.shape
        hkv = kv.shape[2]
        qf = q.float().view(n, hkv, h // hkv, d)                                   # [n, Hkv, g, D]
        q_pos = self.shards[self.rank].positions(q.device)
        scores = torch.empty(hkv, h // hkv, n, self.columns[-1], dtype=torch.float32, device=q.device)

        def score_block(source: int, k: torch.Tensor) -> None:                     # k [m, Hkv, D]
            block = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * self.scale
            k_pos = self.shards[source].positions(q.device)
            block.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
            scores[..., self.columns[source]:self.columns[source + 1]] = block

        self.ring_pass.run(kv[:, 0].contiguous(), score_block, between)           # round 1: K
        probs = torch.softmax(scores, dim=-1)
        out = torch.zeros(n, hkv, h // hkv, d, dtype=torch.float32, device=q.device)

        def value_block(source: int, v: torch.Tensor) -> None:                     # v [m, Hkv, D]
            p = probs[..., self.columns[source]:self.columns[source + 1]]
            out.add_(torch.einsum("hgqk,khd->qhgd", p, v.float()))

        self.ring_pass.run(kv[:, 1].contiguous(), value_block)                    # round 2: V
        return out.view(n, h, d).to(q.dtype)


class RingRSAStrategy(PrefillStrategy):
    """ring-rsa: RingSelfAttention over zigzag shards (the ring, K then V)."""
    name = "ring-rsa"

    def attention(self, ctx: PrefillContext, shards: list[Shard], rank: int) -> Attention:
        return RingSelfAttention(ctx.ring, shards, rank, ctx.scale, ctx.overlap)

"""CQS-Attention (Bian & Somani 2025): cyclic quorum sets instead of a ring.

The prompt is cut into W contiguous token groups; worker w owns group w. Worker w's quorum is
{(a + w) mod W : a in D} for a difference cover D of Z_W (every non-zero residue is a difference of
two members), so every pair of groups meets in some quorum. The scheduler gives each pair to
exactly one worker (the least loaded quorum holding both; the diagonal (g, g) to worker g), the same
plan computed on every worker;
with a causal mask a pair x < y is one full block: queries of y against keys of x. Per layer:
one all-to-all brings each worker the Q, K, V of the groups its pairs need; it computes partial
(out, lse) with the local kernel; a second all-to-all sends each partial to the group's owner (the
tiler), which merges them in fp32. The KV cache keeps each worker's own group, so decoding is the
same as after `burst`.
"""
import itertools
import logging
import math
from functools import lru_cache

import torch
import torch.distributed as dist

from burstserve.engine.core.placement import Shard, ShardLayout
from burstserve.engine.parallel.strategy import Attention, PrefillContext, PrefillStrategy
from burstserve.kernels.attention import AttentionBackend
from burstserve.kernels.merge import merge_partials

log = logging.getLogger(__name__)
MAX_SEARCH_WORKERS = 64


@lru_cache(maxsize=None)
def difference_cover(workers: int) -> tuple[int, ...]:
    """A smallest set D containing 0 (and 1) whose differences cover Z_workers, by exhaustive search
    from ceil(sqrt(W)) up; above MAX_SEARCH_WORKERS, all of Z_W (every worker sees every group)."""
    if workers <= 2:
        return tuple(range(workers))
    if workers > MAX_SEARCH_WORKERS:
        log.warning("cqs: no cyclic quorum searched for %d workers; using the trivial one (all groups)", workers)
        return tuple(range(workers))
    for size in range(math.isqrt(workers - 1) + 1, workers + 1):
        for rest in itertools.combinations(range(2, workers), size - 2):
            cover = (0, 1) + rest
            if len({(a - b) % workers for a in cover for b in cover}) == workers:
                return cover
    return tuple(range(workers))


class CQSPlan:
    """Which (query group, key group) blocks each worker computes, and which groups it needs."""

    def __init__(self, workers: int):
        cover = difference_cover(workers)
        self.quorums = [sorted({(a + w) % workers for a in cover}) for w in range(workers)]
        self.tasks: list[list[tuple[int, int]]] = [[] for _ in range(workers)]   # (query group, key group)
        for g in range(workers):
            self.tasks[g].append((g, g))
        holders = {(y, x): [w for w in range(workers) if x in self.quorums[w] and y in self.quorums[w]]
                   for x, y in itertools.combinations(range(workers), 2)}          # x < y: queries y, keys x
        owner = {}
        for pair, ws in holders.items():
            owner[pair] = min(ws, key=lambda w: (len(self.tasks[w]), w))            # least loaded, then lowest
            self.tasks[owner[pair]].append(pair)
        self._rebalance(holders, owner)
        self.needs = [sorted({g for pair in t for g in pair}) for t in self.tasks]

    def _rebalance(self, holders: dict, owner: dict) -> None:
        """Moves blocks to a less loaded holder while that helps (deterministic: fixed pair order)."""
        moved = True
        while moved:
            moved = False
            for pair, ws in holders.items():
                here = owner[pair]
                best = min(ws, key=lambda w: (len(self.tasks[w]), w))
                if len(self.tasks[best]) + 1 < len(self.tasks[here]):
                    self.tasks[here].remove(pair)
                    self.tasks[best].append(pair)
                    owner[pair] = best
                    moved = True
        self.query_groups = [sorted({q for q, _ in t}) for t in self.tasks]


class CQSAttention:
    def __init__(self, backend: AttentionBackend, shards: list[Shard], rank: int, scale: float, group=None):
        self.backend, self.shards, self.rank, self.scale, self.group = backend, shards, rank, scale, group
        self.workers = len(shards)
        self.lengths = [s.length for s in shards]
        self.plan = CQSPlan(self.workers)

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, between) -> torch.Tensor:
        """q [n, H, D], kv [n, 2, Hkv, D] (my group) -> out [n, H, D]; between() first (no ring)."""
        between()
        n, h, d = q.shape
        hkv = kv.shape[2]
        packed = torch.cat([q.reshape(n, h * d), kv.reshape(n, 2 * hkv * d)], dim=1)      # [n, (H + 2Hkv) D]
        groups = self._gather_groups(packed)                                              # group -> packed rows
        partials = {}                                                                     # query group -> list
        for qg, kg in self.plan.tasks[self.rank]:
            rows_q, rows_k = groups[qg], groups[kg]
            gq = rows_q[:, :h * d].view(-1, h, d)
            gkv = rows_k[:, h * d:].view(-1, 2, hkv, d)
            out, lse = self.backend(gq, gkv[:, 0], gkv[:, 1], qg == kg, self.scale)
            partials.setdefault(qg, []).append(torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1))
        mine = self._send_partials(partials, n, h, d)                                     # [P, n, H, D + 1]
        return merge_partials(mine[..., :-1], mine[..., -1], q.dtype)[0]                 # [n, H, D]

    def _gather_groups(self, packed: torch.Tensor) -> dict[int, torch.Tensor]:
        """All-to-all: my group goes to every worker that needs it; I get the groups I need."""
        send_to = [w for w in range(self.workers) if self.rank in self.plan.needs[w]]
        send = torch.cat([packed] * len(send_to)) if send_to else packed[:0]
        send_sizes = [self.lengths[self.rank] if w in send_to else 0 for w in range(self.workers)]
        recv_sizes = [self.lengths[g] if g in self.plan.needs[self.rank] else 0 for g in range(self.workers)]
        recv = self._all_to_all(send, send_sizes, recv_sizes)
        return dict(zip(range(self.workers), recv.split(recv_sizes)))

    def _send_partials(self, partials: dict[int, list[torch.Tensor]], n: int, h: int, d: int) -> torch.Tensor:
        """All-to-all to the tilers: each partial goes to its query group's owner; returns mine stacked."""
        sources = [w for w in range(self.workers) if self.rank in self.plan.query_groups[w]]
        counts = {w: sum(1 for q, _ in self.plan.tasks[w] if q == self.rank) for w in sources}
        blocks, send_sizes = [], []
        for g in range(self.workers):
            parts = partials.get(g, [])
            blocks += parts
            send_sizes.append(len(parts) * self.lengths[g])
        device = next(iter(partials.values()))[0].device
        send = torch.cat(blocks) if blocks else torch.empty(0, h, d + 1, device=device)
        recv_sizes = [counts.get(w, 0) * n for w in range(self.workers)]
        recv = self._all_to_all(send, send_sizes, recv_sizes)
        return recv.view(sum(counts.values()), n, h, d + 1)

    def _all_to_all(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        recv = torch.empty((sum(recv_sizes),) + tuple(send.shape[1:]), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=recv_sizes,
                               input_split_sizes=send_sizes, group=self.group)
        return recv


class CQSStrategy(PrefillStrategy):
    """cqs: CQSAttention over contiguous token groups (worker w keeps group w's K/V)."""
    name = "cqs"
    shard_layout = ShardLayout.CONTIGUOUS

    def attention(self, ctx: PrefillContext, shards: list[Shard], rank: int) -> Attention:
        return CQSAttention(ctx.backend, shards, rank, ctx.scale, ctx.data_group)

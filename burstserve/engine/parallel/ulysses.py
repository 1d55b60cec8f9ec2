"""DeepSpeed-Ulysses: all-to-all over heads.

Each worker holds its shard's Q, K, V for every head. One all-to-all gives every worker the whole
sequence for H/G heads; it runs ordinary causal attention on it (sorted by position), and a second
all-to-all returns each worker its own tokens with every head. K/V heads that do not divide by G
are repeated up to the query heads first. The KV cache keeps the shard's own K/V, as `burst` does.
"""
import torch
import torch.distributed as dist

from burstserve.engine.core.placement import Shard
from burstserve.engine.model.config import ModelConfig
from burstserve.engine.parallel.strategy import Attention, PrefillContext, PrefillStrategy
from burstserve.kernels.attention import AttentionBackend


class UlyssesAttention:
    def __init__(self, backend: AttentionBackend, shards: list[Shard], rank: int, scale: float, group=None):
        self.backend, self.shards, self.rank, self.scale, self.group = backend, shards, rank, scale, group
        self.world_size = len(shards)
        self.lengths = [s.length for s in shards]
        self._sort: torch.Tensor | None = None

    def _sort_on(self, device: torch.device) -> torch.Tensor:
        """[N] index that puts the rank-ordered rows in position order, built once on the device (no
        N-sized CPU work, which ran multi-threaded per prefill from 32K tokens up)."""
        if self._sort is None or self._sort.device != device:
            rank_order = torch.cat([s.positions(device) for s in self.shards])  # [N] positions, by rank
            sort = torch.empty_like(rank_order)
            sort[rank_order] = torch.arange(rank_order.shape[0], device=device)  # the inverse permutation
            self._sort = sort
        return self._sort

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, between) -> torch.Tensor:
        """q [n, H, D], kv [n, 2, Hkv, D] -> out [n, H, D]; between() first (no ring)."""
        between()
        h = q.shape[1]
        if h % self.world_size:
            raise ValueError(f"ulysses needs the {h} query heads to divide by {self.world_size} workers")
        k, v = kv[:, 0], kv[:, 1]
        if k.shape[1] % self.world_size:
            k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
        sort = self._sort_on(q.device)
        q_all, k_all, v_all = (self._seq_to_heads(x)[sort] for x in (q, k, v))  # [N, heads/G, D], sorted
        out_sorted, _ = self.backend(q_all, k_all, v_all, True, self.scale)
        out_rank_order = torch.empty_like(out_sorted)
        out_rank_order[sort] = out_sorted
        return self._heads_to_seq(out_rank_order)

    def _seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[n, Hx, D] (my tokens, all heads) -> [N, Hx/G, D] (all tokens by rank, my heads)."""
        g, (n, hx, d) = self.world_size, x.shape
        send = x.reshape(n, g, hx // g, d).transpose(0, 1).contiguous().view(g * n, hx // g, d)
        recv = torch.empty(sum(self.lengths), hx // g, d, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(recv, send, output_split_sizes=self.lengths, input_split_sizes=[n] * g,
                               group=self.group)
        return recv

    def _heads_to_seq(self, y: torch.Tensor) -> torch.Tensor:
        """[N, H/G, D] (all tokens by rank, my heads) -> [n, H, D] (my tokens, all heads)."""
        g, n = self.world_size, self.lengths[self.rank]
        hg, d = y.shape[1], y.shape[2]
        recv = torch.empty(g * n, hg, d, dtype=y.dtype, device=y.device)
        dist.all_to_all_single(recv, y.contiguous(), output_split_sizes=[n] * g, input_split_sizes=self.lengths,
                               group=self.group)
        return recv.view(g, n, hg, d).transpose(0, 1).reshape(n, g * hg, d)


class UlyssesStrategy(PrefillStrategy):
    """ulysses: UlyssesAttention over zigzag shards (two all-to-alls a layer, no ring)."""
    name = "ulysses"

    def model_refusal(self, cfg: ModelConfig) -> str | None:
        """Each worker attends over H/W whole heads: the workers must divide the query heads."""
        if cfg.num_heads % self.world_size:
            return (f"ulysses splits the {cfg.num_heads} attention heads over the workers; {self.world_size} workers "
                    "do not divide them")
        return None

    def attention(self, ctx: PrefillContext, shards: list[Shard], rank: int) -> Attention:
        return UlyssesAttention(ctx.backend, shards, rank, ctx.scale, ctx.data_group)

"""Megatron-LM's sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022; the BurstAttention paper's "TP (Megatron V3)" baseline) for a tp prefill.

Under tp (Megatron V1) every worker holds every token's activations and an all-reduce follows the
row-parallel linears (o_proj, down_proj). Here the activations between the parallel linears are cut by
sequence: worker r holds prompt rows [r P, (r + 1) P) (P = ceil(N / G); the prompt padded at the end to
G P rows, padding attended by nobody before it), its norms and residual adds run on those rows only; an
all-gather brings the normed rows whole before the column-parallel linears (q/k/v, gate/up), and a
reduce-scatter of the row-parallel linears' partial sums returns each worker its rows (the all-reduce
cut in its two halves). Attention in between runs on all rows for the worker's heads, as under tp.
Decode steps and incremental prefills stay Megatron V1 (one token per sequence: nothing to cut).
"""
import torch
import torch.distributed as dist

from burstserve.engine.parallel.decode_attention import all_gather
from burstserve.kernels.arith import ceil_div


class SequenceParallel:
    def __init__(self, num_tokens: int, rank: int, world_size: int, group=None):
        self.num_tokens, self.rank, self.world_size, self.group = num_tokens, rank, world_size, group
        self.per_rank = ceil_div(num_tokens, world_size)                # P
        self.padded = self.per_rank * world_size                    # G P

    def local_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [N] -> this worker's rows [P] (past the prompt's end: token 0, padding)."""
        out = torch.zeros(self.per_rank, dtype=token_ids.dtype)
        start = self.rank * self.per_rank
        mine = token_ids[start:start + self.per_rank]
        out[:mine.shape[0]] = mine
        return out

    def last_row(self) -> tuple[int, int]:
        """(rank, local row) holding the prompt's last token."""
        return divmod(self.num_tokens - 1, self.per_rank)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [P, ...] on every worker -> [G P, ...]: every worker's rows in rank order."""
        return all_gather(x, self.world_size, self.group).flatten(0, 1)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [G P, ...] partial sums on every worker -> this worker's rows [P, ...] of their sum. gloo (CPU)
        has no reduce-scatter: an all-reduce and this worker's rows, the same numbers."""
        if x.is_cuda:
            out = x.new_empty((self.per_rank,) + x.shape[1:])
            dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group)
            return out
        dist.all_reduce(x, group=self.group)
        return x[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]

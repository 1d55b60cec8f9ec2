"""Decode attention over the distributed KV cache.

Every worker runs the same new tokens through the model. For attention, each worker attends
them to the K/V it holds (its prompt shard plus the decoded tokens it was given), producing a
partial (out, lse); one all-gather per layer brings every worker's partials, and each worker
merges them identically, so all end the layer with the same hidden state.
"""
import torch
import torch.distributed as dist

from engine.kv_cache import SequenceKV
from kernels.attention import AttentionBackend
from kernels.merge import merge_stacked


class DecodeAttention:
    def __init__(self, backend: AttentionBackend, scale: float, world_size: int, group=None):
        self.backend, self.scale, self.world_size, self.group = backend, scale, world_size, group
        self.seqs: list[SequenceKV] = []
        self.owned: list[bool] = []      # does this worker store the new token of each sequence?

    def begin_step(self, seqs: list[SequenceKV], owned: list[bool]) -> None:
        """Sets the batch for the next forward pass; grows caches that receive a token."""
        self.seqs, self.owned = seqs, owned
        for seq, own in zip(seqs, owned):
            if own:
                seq.ensure_capacity(seq.length + 1)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, D], k and v [B, Hkv, D] (one new token per sequence) -> out [B, H, D]."""
        outs, lses = [], []
        for b, (seq, own) in enumerate(zip(self.seqs, self.owned)):
            n = seq.length
            if own:
                seq.write(layer, n, k[b:b + 1], v[b:b + 1])
                n += 1
            block = seq.block(layer, n)                                   # [n, 2, Hkv, D]
            out, lse = self.backend(q[b:b + 1], block[:, 0], block[:, 1], False, self.scale)
            outs.append(out)
            lses.append(lse)
        local_out = torch.cat(outs).float()                               # [B, H, D]
        local_lse = torch.cat(lses)                                       # [B, H]
        if self.world_size == 1:
            return local_out.to(q.dtype)
        packed = torch.cat([local_out, local_lse.unsqueeze(-1)], dim=-1)  # [B, H, D + 1]
        gathered = all_gather(packed, self.world_size, self.group)        # [G, B, H, D + 1]
        out, _ = merge_stacked(gathered[..., :-1], gathered[..., -1])
        return out.to(q.dtype)

    def end_step(self) -> None:
        for seq, own in zip(self.seqs, self.owned):
            if own:
                seq.length += 1


def all_gather(x: torch.Tensor, world_size: int, group=None) -> torch.Tensor:
    """x [...] -> [world_size, ...]; one collective."""
    if x.is_cuda:
        out = torch.empty((world_size,) + x.shape, dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)

"""Decode attention over the distributed, paged KV cache: one kernel call per layer for the batch.

Every worker runs the same new tokens (one per sequence) through the model. For attention, each
worker writes the new K/V of the sequences whose token it stores (the others' go to the scratch
page), attends every new token to the K/V it holds with one `paged_attention` call, and gets a
partial (out, lse); one all-gather per layer brings every worker's partials, and each worker merges
them identically, so all end the layer with the same hidden state.

The step's tensors (slots, block table, lengths) are set by `begin_step` and read by every layer;
under a CUDA graph they are static buffers refilled before each replay.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from burstserve.engine.pages.page_pool import PagePool
from burstserve.kernels.merge import merge_partials
from burstserve.kernels.paged_attention import paged_attention


@dataclass
class DecodeStep:
    """One decode step's tensors on the device, B sequences."""
    slots: torch.Tensor         # [B] int64: where each new token's K/V goes on this worker (scratch if not here)
    block_table: torch.Tensor   # [B, max_pages] int32
    seq_lens: torch.Tensor      # [B] int32: keys on this worker, the new token's included when stored here
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: 0, 1, .., B


class DecodeAttention:
    def __init__(self, pool: PagePool, scale: float, world_size: int, group=None, backend: str = "auto",
                 windows: tuple[int, ...] = ()):
        """windows: per layer its sliding window (ModelConfig.layer_windows; 0 or empty: full)."""
        self.pool, self.scale, self.world_size, self.group = pool, scale, world_size, group
        self.windows = windows
        self.backend = backend          # kernels.paged_attention backend
        self.step: DecodeStep | None = None

    def begin_step(self, step_inputs: torch.Tensor, num_pages: int | None) -> None:
        """This step's tensors, from step_inputs [5, B] int64 on the device (tokens, positions, slots, lens, rows);
        num_pages: the block table's width (None: the pool's maximum)."""
        tokens, positions, slots, lens, rows = step_inputs
        b = tokens.shape[0]
        pages = self.pool.table if num_pages is None else self.pool.table[:, :num_pages]
        # gathered behind one spare entry (kernels.paged_attention.guarded_table: flash-attn-4 reads the
        # entry before a row without keys), once for every layer of the step
        buf = torch.empty(1 + b * pages.shape[1], dtype=torch.int32, device=tokens.device)
        table = torch.index_select(pages, 0, rows, out=buf[1:].view(b, pages.shape[1]))   # [B, pages] int32
        cu = torch.arange(b + 1, dtype=torch.int32, device=tokens.device)
        self.step = DecodeStep(slots, table, lens.to(torch.int32), cu)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, D], k and v [B, Hkv, D] (one new token per sequence) -> out [B, H, D]."""
        step = self.step
        self.pool.write(layer, step.slots, k, v)
        window = (self.windows[layer] or None) if self.windows else None     # a sliding window: its last keys
        out, lse = paged_attention(q, *self.pool.layer(layer), step.block_table, step.cu_seqlens_q,
                                   step.seq_lens, self.scale, causal=False, backend=self.backend,   # one query: sees every key
                                   max_seqlen_q=1, window=window)
        if self.world_size == 1:
            return out
        return merge_over_workers(out, lse, self.world_size, self.group)


def merge_over_workers(out: torch.Tensor, lse: torch.Tensor, world_size: int, group=None) -> torch.Tensor:
    """Each worker's partial over the keys it holds, out [R, H, D] and lse [R, H] for the same R query
    rows on every worker -> the rows' attention over all keys, out [R, H, D] in out's dtype, identical
    on every worker: one all-gather of the partials (fp32), merged in fp32 (one Triton kernel on GPUs)."""
    packed = torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1)          # [R, H, D + 1]
    gathered = all_gather(packed, world_size, group)                      # [G, R, H, D + 1]
    merged, _ = merge_partials(gathered[..., :-1], gathered[..., -1], out.dtype)
    return merged


def all_gather(x: torch.Tensor, world_size: int, group=None) -> torch.Tensor:
    """x [...] -> [world_size, ...]; one collective."""
    return stacked(start_all_gather(x, world_size, group)[0])


def start_all_gather(x: torch.Tensor, world_size: int, group=None, async_op: bool = False):
    """Gathers every worker's x -> (what `stacked` turns into [world_size, ...], the work if async_op):
    one tensor on CUDA (all_gather_into_tensor), a list on gloo."""
    x = x.contiguous()
    if x.is_cuda:
        out = torch.empty((world_size,) + x.shape, dtype=x.dtype, device=x.device)
        return out, dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
    parts = [torch.empty_like(x) for _ in range(world_size)]
    return parts, dist.all_gather(parts, x, group=group, async_op=async_op)


def stacked(gathered) -> torch.Tensor:
    return torch.stack(gathered) if isinstance(gathered, list) else gathered


def all_gather_rows(x: torch.Tensor, lengths: list[int], group=None) -> torch.Tensor:
    """x [lengths[rank], ...] on each worker -> [sum(lengths), ...]: every worker's rows in rank order."""
    longest = max(lengths)
    padded = x.new_zeros((longest,) + x.shape[1:])
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, lengths)])

"""Decode on tensor-parallel weight shards over a sequence-sharded KV cache (`burst-zero`; NVIDIA's
"Helix" shape): no weight moves at decode.

Each worker's projections give the batch's q, k, v for its own heads only (q [B, H/W, D], k and v
[B, Hkv_r, D]: tp's slices), while its KV cache holds its tokens' K/V for every head. Per layer: one
all-gather of the workers' [q, k, v] rows makes every head's q, k, v on every worker (each K/V head
from the first worker that has it); then the decode step's attention as for replicated weights
(engine/decode_attention.py: the new K/V written where the token is stored, one paged_attention call
over this worker's keys for every head, one all-gather of the partials merged in fp32), and the
worker keeps its own heads' rows for its slice of o_proj; tp's all-reduce follows o and down.
Four collectives a layer, every one capturable in the decode CUDA graphs.
"""
import torch

from engine.config import ModelConfig
from engine.decode_attention import DecodeAttention, all_gather
from engine.parallel.tensor_parallel import qkv_row_index


class HelixDecodeAttention:
    def __init__(self, inner: DecodeAttention, cfg: ModelConfig, rank: int, world_size: int, group=None):
        """inner: the step's attention over every head (its `step` is set by ModelRunner as usual);
        cfg: the whole model's config."""
        self.inner, self.cfg, self.world_size, self.group = inner, cfg, world_size, group
        per_q = cfg.num_heads // world_size
        self.heads = slice(rank * per_q, (rank + 1) * per_q)
        self.columns = qkv_row_index(cfg, world_size).to(inner.pool.device)   # stacked rows -> whole [q, k, v]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H/W, D], k and v [B, Hkv_r, D] (this worker's heads) -> out [B, H/W, D]."""
        b, h, hkv, d = q.shape[0], self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        mine = torch.cat([q.reshape(b, -1), k.reshape(b, -1), v.reshape(b, -1)], dim=1)      # [B, C]
        stacked = all_gather(mine, self.world_size, self.group)                             # [W, B, C]
        whole = stacked.permute(1, 0, 2).flatten(1).index_select(1, self.columns)           # [B, (H + 2 Hkv) D]
        q_all, k_all, v_all = whole.split([h * d, hkv * d, hkv * d], dim=1)
        out = self.inner(layer, q_all.view(b, h, d), k_all.view(b, hkv, d), v_all.view(b, hkv, d))   # [B, H, D]
        return out[:, self.heads]

"""Decode on burst-zero's weights as they lie (NVIDIA's "Helix" shape): no weight moves at decode.

Each worker holds the q/k/v projection whole, tp's slices of o and the MLP, and in its KV cache its tokens'
K/V for every head. Per layer: the whole projection gives the batch's q, k, v for every head on every
worker; the decode step's attention runs as for replicated weights (engine/decode_attention.py: the new
K/V written where the token is stored, one paged_attention call over this worker's keys for every head,
one all-gather of the partials merged in fp32); the worker keeps its own heads' rows for its slice of o,
and tp's all-reduce follows o and down. Three collectives a layer, every one capturable in the decode
CUDA graphs.
"""
import torch

from engine.config import ModelConfig
from engine.decode_attention import DecodeAttention
from engine.parallel.tensor_parallel import tp_heads


class HelixDecodeAttention:
    def __init__(self, inner: DecodeAttention, cfg: ModelConfig, rank: int, world_size: int, group=None):
        """inner: the step's attention over every head (its `step` is set by ModelRunner as usual);
        cfg: the whole model's config."""
        self.inner = inner
        self.heads, _ = tp_heads(cfg, rank, world_size)        # the query heads this worker's slice of o reads

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, D], k and v [B, Hkv, D] (every head) -> out [B, H/W, D] (this worker's heads)."""
        return self.inner(layer, q, k, v)[:, self.heads]

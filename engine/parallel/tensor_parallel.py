"""Tensor parallelism (Megatron-style), the strategy most serving systems use, as a baseline.

Applied from outside, as gpt-fast's tp.py does: each worker keeps H/G query heads (and the K/V
heads they read), a 1/G slice of the MLP, and the whole embedding and LM head; the model adds an
all-reduce after the attention output and the MLP down projection. Every worker sees the whole
prompt; its KV cache holds every token for its own heads.
"""
from dataclasses import replace

import torch

from engine.config import ModelConfig
from engine.parallel.sharding import Shard, zigzag_shards
from engine.parallel.strategy import Attention, PrefillContext, PrefillStrategy


def tp_check(cfg: ModelConfig, world_size: int) -> str | None:
    """Why this model cannot be split over world_size workers, or None."""
    if cfg.num_heads % world_size:
        return f"tp splits the {cfg.num_heads} attention heads over the workers; {world_size} do not divide them"
    if cfg.intermediate_size % world_size:
        return f"tp splits the MLP width {cfg.intermediate_size}; {world_size} workers do not divide it"
    return None


def local_kv_heads(cfg: ModelConfig, rank: int, world_size: int) -> list[int]:
    """The K/V heads this worker's query heads read (GQA: several workers may share one)."""
    per = cfg.num_heads // world_size
    return sorted({h // cfg.kv_groups for h in range(rank * per, (rank + 1) * per)})


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], rank: int,
                  world_size: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Slices transformers-named weights in place for this worker; returns the worker's config."""
    d, per_q = cfg.head_dim, cfg.num_heads // world_size
    kv_heads = local_kv_heads(cfg, rank, world_size)
    inter = cfg.intermediate_size // world_size
    q_rows = slice(rank * per_q * d, (rank + 1) * per_q * d)
    kv_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kv_heads])
    mlp_rows = slice(rank * inter, (rank + 1) * inter)
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for suffix in ("weight", "bias"):
            if a + f"q_proj.{suffix}" in weights:
                weights[a + f"q_proj.{suffix}"] = weights[a + f"q_proj.{suffix}"][q_rows].contiguous()
                for x in "kv":
                    weights[a + f"{x}_proj.{suffix}"] = weights[a + f"{x}_proj.{suffix}"][kv_rows.to(
                        weights[a + f"{x}_proj.{suffix}"].device)].contiguous()
        weights[a + "o_proj.weight"] = weights[a + "o_proj.weight"][:, q_rows].contiguous()
        weights[m + "gate_proj.weight"] = weights[m + "gate_proj.weight"][mlp_rows].contiguous()
        weights[m + "up_proj.weight"] = weights[m + "up_proj.weight"][mlp_rows].contiguous()
        weights[m + "down_proj.weight"] = weights[m + "down_proj.weight"][:, mlp_rows].contiguous()
    local = replace(cfg, num_heads=per_q, num_kv_heads=len(kv_heads), intermediate_size=inter)
    return local, weights


class TensorParallelStrategy(PrefillStrategy):
    """tp: every worker runs the whole prompt (one shard) for its own heads and keeps every token's K/V
    for them. On one worker there is nothing to split: the weights stay whole, its K/V is its own."""
    name = "tp"

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.replicated_kv = world_size > 1

    def shards(self, num_tokens: int) -> list[Shard]:
        return zigzag_shards(num_tokens, 1)                     # the whole prompt, in position order

    def shard_of(self, shards: list[Shard], rank: int) -> Shard:
        return shards[0]

    def tokens_per_rank(self, shards: list[Shard]) -> list[int]:
        return [shards[0].length] * self.world_size

    def attention(self, ctx: PrefillContext, shards: list[Shard], rank: int) -> Attention:
        return lambda q, kv: ctx.backend(q, kv[:, 0], kv[:, 1], True, ctx.scale)[0]   # one causal kernel call

    def local_weights(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                      rank: int) -> tuple[ModelConfig, dict[str, torch.Tensor], bool]:
        if not self.replicated_kv:
            return cfg, weights, False
        local, weights = shard_weights(cfg, weights, rank, self.world_size)
        return local, weights, True                             # all-reduce after o_proj and down_proj

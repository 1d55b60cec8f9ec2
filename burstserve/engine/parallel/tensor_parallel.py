"""Tensor parallelism (Megatron-style), the strategy most serving systems use, as a baseline.

Applied from outside, as gpt-fast's tp.py does: each worker keeps H/G query heads (and the K/V
heads they read), a 1/G slice of the MLP (of every expert's, cut by width: engine/model/moe.py), and the
whole embedding and LM head; the model adds an all-reduce after the attention output and the MLP
down projection. Every worker sees the whole
prompt; its KV cache holds every token for its own heads. gate_up_row_index puts the workers' MLP
slices, stacked, back in the whole weights' order (burst-zero: engine/parallel/zero.py).
"""
from dataclasses import replace

import torch

from burstserve.engine.core.placement import Shard, ShardLayout
from burstserve.engine.model.config import ModelConfig
from burstserve.engine.model.moe import expert_slices
from burstserve.engine.parallel.sequence_parallel import SequenceParallel
from burstserve.engine.parallel.strategy import Attention, PrefillContext, PrefillStrategy


def tp_check(cfg: ModelConfig, world_size: int) -> str | None:
    """Why this model cannot be split over world_size workers, or None."""
    if cfg.num_heads % world_size:
        return f"tp splits the {cfg.num_heads} attention heads over the workers; {world_size} do not divide them"
    return mlp_split_refusal(cfg, world_size, "tp")


def mlp_split_refusal(cfg: ModelConfig, world_size: int, strategy: str) -> str | None:
    """Why world_size workers cannot cut this model's MLPs by width (tp's and burst-zero's slices), or None: the
    dense MLP's width, each expert's and the shared expert's must divide."""
    widths = []
    if len(cfg.sparse_layers) < cfg.num_layers:
        widths.append(("the MLP width", cfg.intermediate_size))
    if cfg.num_experts:
        widths.append((f"each of the {cfg.num_experts} experts' width", cfg.moe_intermediate_size))
    if cfg.shared_expert_intermediate_size:
        widths.append(("the shared expert's width", cfg.shared_expert_intermediate_size))
    for what, width in widths:
        if width % world_size:
            return f"{strategy} splits {what} {width}; {world_size} workers do not divide it"
    return None


def local_kv_heads(cfg: ModelConfig, rank: int, world_size: int) -> list[int]:
    """The K/V heads this worker's query heads read (GQA: several workers may share one)."""
    per = cfg.num_heads // world_size
    return sorted({h // cfg.kv_groups for h in range(rank * per, (rank + 1) * per)})


def tp_slices(cfg: ModelConfig, rank: int, world_size: int) -> dict[str, tuple[int, int, int]]:
    """The Megatron layout of this worker's part: name -> (dim, start, stop). Rows (dim 0) of q/k/v
    (its query heads and the K/V heads they read: a contiguous run) and of gate/up; columns (dim 1)
    of o and down. Embedding, norms and LM head are not listed: read whole."""
    d, per_q = cfg.head_dim, cfg.num_heads // world_size
    kv_heads = local_kv_heads(cfg, rank, world_size)
    q_rows = (rank * per_q * d, (rank + 1) * per_q * d)
    kv_rows = (kv_heads[0] * d, (kv_heads[-1] + 1) * d)
    slices = mlp_slices(cfg, rank, world_size)
    for i in range(cfg.num_layers):
        a = f"model.layers.{i}.self_attn."
        suffixes = ("weight", "bias") if cfg.qkv_bias else ("weight",)
        for suffix in suffixes:
            slices[a + f"q_proj.{suffix}"] = (0, *q_rows)
            slices[a + f"k_proj.{suffix}"] = slices[a + f"v_proj.{suffix}"] = (0, *kv_rows)
        slices[a + "o_proj.weight"] = (1, *q_rows)
    return slices


def mlp_slices(cfg: ModelConfig, rank: int, world_size: int) -> dict[str, tuple[int, int, int]]:
    """This worker's part of the MLP (tp's, and burst-zero's only slices but the vocabulary's): rows of
    gate/up, columns of down; of every expert's in a sparse layer (engine/model/moe.py, expert_slices)."""
    inter = cfg.intermediate_size // world_size
    mlp = (rank * inter, (rank + 1) * inter)
    slices = {}
    for i in range(cfg.num_layers):
        if cfg.is_sparse(i):
            slices.update(expert_slices(cfg, i, rank, world_size))
            continue
        m = f"model.layers.{i}.mlp."
        slices[m + "gate_proj.weight"] = slices[m + "up_proj.weight"] = (0, *mlp)
        slices[m + "down_proj.weight"] = (1, *mlp)
    return slices


def sliced_mlp_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """cfg with the widths of a worker's MLP slices: the dense MLP's, each expert's, the shared expert's."""
    return replace(cfg, intermediate_size=cfg.intermediate_size // world_size,
                   moe_intermediate_size=cfg.moe_intermediate_size // world_size,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // world_size)


def tp_local_config(cfg: ModelConfig, rank: int, world_size: int) -> ModelConfig:
    """This worker's config under tp: its query heads, the K/V heads they read, its MLP width."""
    return replace(sliced_mlp_config(cfg, world_size), num_heads=cfg.num_heads // world_size,
                   num_kv_heads=len(local_kv_heads(cfg, rank, world_size)))


def gate_up_row_index(width: int, world_size: int) -> torch.Tensor:
    """Rows of the workers' stacked [gate_r; up_r] slices that make the whole [gate; up] of an MLP `width` wide."""
    per = width // world_size
    gate = [r * 2 * per + i for r in range(world_size) for i in range(per)]
    return torch.tensor(gate + [g + per for g in gate], dtype=torch.int64)


class TensorParallelStrategy(PrefillStrategy):
    """tp: every worker runs the whole prompt (one shard) for its own heads and keeps every token's K/V
    for them. On one worker there is nothing to split: the weights stay whole, its K/V is its own."""
    name = "tp"
    shard_layout = ShardLayout.ONE             # the whole prompt, in position order

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.replicated_kv = world_size > 1

    def model_refusal(self, cfg: ModelConfig) -> str | None:
        return tp_check(cfg, self.world_size)

    def attention(self, ctx: PrefillContext, shards: list[Shard], rank: int) -> Attention:
        def attend(q, kv, between):                                      # one causal kernel call
            between()
            return ctx.backend(q, kv[:, 0], kv[:, 1], True, ctx.scale)[0]
        return attend

    def weight_slices(self, cfg: ModelConfig, rank: int) -> dict[str, tuple[int, int, int]]:
        return tp_slices(cfg, rank, self.world_size) if self.replicated_kv else {}

    def local_config(self, cfg: ModelConfig, rank: int) -> tuple[ModelConfig, bool]:
        if not self.replicated_kv:
            return cfg, False
        return tp_local_config(cfg, rank, self.world_size), True   # all-reduce after o_proj and down_proj


class TensorParallelV3Strategy(TensorParallelStrategy):
    """tp-v3 (Megatron V3, the BurstAttention paper's main baseline): tp's weights, K/V and decode, with a
    prefill's norms and residual adds cut by sequence between the parallel linears (all-gather before
    the column-parallel ones, reduce-scatter after the row-parallel ones: engine/parallel/sequence_parallel.py)."""
    name = "tp-v3"

    def sequence_parallel(self, num_tokens: int, rank: int, group=None) -> SequenceParallel | None:
        return SequenceParallel(num_tokens, rank, self.world_size, group) if self.replicated_kv else None


"""How one worker's weights lie, and what follows from it: the runner asks its WeightLayout
(`PrefillStrategy.weight_layout`) instead of asking which strategy it runs.

A layout answers, for its worker:
  build_model(weights, reduce, quantization, kv_cache_dtype, fp8_attention)   the model on these weights (the layout keeps it),
                                               all-reduced after o_proj where attention_sums (tp's slices);
  vocab / whole_layers                         the vocabulary cut over the workers (VocabShards) and what
                                               gathers a prefill layer's whole weights (LayerGather), or None;
  attn_cfg                                     the heads a prefill attends with and the K/V cache holds;
  reserve_bytes()                              GPU memory to leave free when the KV pool is sized;
  extend_attention(attend)                     an eager extend's attention and whole layers;
  sliced_limit(...) / prefill_on_slices(...)   the longest prompt run on the weight slices, and running one;
  logits_of_row(hidden, owner, row)            the logits of one worker's row, on every worker;
  prompt_scores(...)                           a prefill's prompt logprobs scored: every worker's part, on worker 0.

WeightLayout itself: the weights whole on every worker, or tp's slices with the model's all-reduce after
o_proj and down_proj (PrefillStrategy.local_config). Every worker runs its own rows on the weights it
holds, and the LM head is whole, so the worker holding a row computes its logits. burst-zero's MLP slices,
gathered whole for each prefill layer, are engine/parallel/zero.py's ZeroLayout.
"""
from typing import Callable

import torch
import torch.distributed as dist

from burstserve.engine.core.prompt_logprobs import gather_scores, score_rows
from burstserve.engine.model.config import ModelConfig
from burstserve.engine.model.model import AttendFn, LlamaModel


def global_rank(rank: int, group=None) -> int:
    """The rank in the default process group of `group`'s rank `rank` (a collective's src)."""
    return rank if group is None else dist.get_global_rank(group, rank)


class WeightLayout:
    vocab = None               # engine.parallel.vocab.VocabShards: the embedding and LM head cut by vocabulary rows
    whole_layers = None        # engine.parallel.zero.LayerGather: a prefill runs each layer on its whole weights
    sliced_name = ""           # the prefill stats' strategy of a prompt run on the slices
    attention_sums = True      # with partial_sums: o_proj's output too is a partial sum (tp; not burst-zero)

    def __init__(self, cfg: ModelConfig, local: ModelConfig, partial_sums: bool, rank: int, world_size: int,
                 device: torch.device, group=None):
        """cfg: the whole model's config; local: this worker's (its heads and MLP width); partial_sums: the
        model all-reduces after o_proj and down_proj (tp)."""
        self.cfg, self.local, self.partial_sums = cfg, local, partial_sums
        self.rank, self.world_size, self.device, self.group = rank, world_size, device, group
        self.attn_cfg = local
        self.model: LlamaModel | None = None

    def build_model(self, weights: dict[str, torch.Tensor], reduce: Callable[[torch.Tensor], torch.Tensor],
                    quantization: str, kv_cache_dtype: str = "auto", fp8_attention: bool = False) -> LlamaModel:
        """This worker's model on its weights (reduce: the all-reduce, used where partial_sums)."""
        self.model = LlamaModel(self.local, weights, self.device, reduce=reduce if self.partial_sums else None,
                                quantization=quantization, vocab=self.vocab, kv_cache_dtype=kv_cache_dtype,
                                reduce_attention=self.attention_sums, fp8_attention=fp8_attention)
        return self.model

    def reserve_bytes(self) -> int:
        """GPU memory (bytes) the KV pool's sizing leaves free beside the weights: none."""
        return 0

    def extend_attention(self, attend) -> tuple[AttendFn, object]:
        """An eager extend's (engine/runner/extend_attention.py's ExtendAttention) -> (the attention its forward
        uses, the whole-layer gatherer it runs with, or None)."""
        return attend, self.whole_layers

    def sliced_limit(self, limit: int | None, share: int, ctx) -> int:
        """The longest prompt run on the weight slices (--zero-sliced-max-tokens `limit`, share: a worker's
        share of max_model_len, ctx: the runner's PrefillContext): none."""
        return 0

    def prefill_on_slices(self, ctx, pool, slots: torch.Tensor, shards: list, token_ids: torch.Tensor) -> torch.Tensor:
        """A prompt of at most sliced_max_tokens run on the weight slices -> the last token's logits [V]."""
        raise NotImplementedError("no prompt runs on the weight slices")

    def logits_of_row(self, hidden: torch.Tensor, owner: int, row: int) -> torch.Tensor:
        """The logits [V] fp32 of row `row` of worker `owner`'s hidden states [n, hidden], computed there and
        broadcast from there (owner 0: the other workers' are left unset; only worker 0 reports them)."""
        if self.rank == owner:
            logits = self.model.logits(hidden[row:row + 1])[0]
        else:
            logits = torch.empty(self.cfg.vocab_size, dtype=torch.float32, device=self.device)
        if owner != 0:
            dist.broadcast(logits, src=global_rank(owner, self.group), group=self.group)
        return logits

    def prompt_scores(self, hidden: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor, top: int,
                      replicated_kv: bool) -> list[dict]:
        """A prefill's hidden states [n, hidden] at `positions` [n] (host) -> engine/core/prompt_logprobs.py's
        scores, every worker's on worker 0: each worker scores the rows it holds (replicated K/V, tp:
        worker 0 holds them all)."""
        if replicated_kv:
            return [score_rows(self.model, hidden, positions, token_ids, top)] if self.rank == 0 else []
        return gather_scores(score_rows(self.model, hidden, positions, token_ids, top), self.world_size, self.group)

"""BurstAttention+ZeRO (`burst-zero`): the BurstAttention paper's sixth method, the weights sharded over
the workers, so that sequence parallelism costs little more weight memory than tensor parallelism.

- Weights: each worker reads tp's slice of the MLP (engine/parallel/tensor_parallel.py: rows of gate/up,
  columns of down; of every expert's in a mixture of experts, the router whole: engine/model/moe.py) and its vocabulary rows of the embedding and LM head (engine/parallel/vocab.py); the
  attention's projections (q/k/v and o: a fifth of llama3-8b's layer, a sixth of llama3-70b's) and the
  norms are whole on every worker, so that a decode step's attention, over every head of the worker's
  sequence shard, needs no collective but the merge of its partials. Where the workers cannot slice the
  model so (`zero_check`: an MLP width or vocabulary they do not divide), every worker holds the whole
  weights and runs as burst, with one line in the log at start (`fallback_note`).
- Prefill and incremental prefills: the prompt is sharded by sequence and attends over the burst K/V
  ring, as `burst`; the model runs each layer with that layer's whole MLP, all-gathered from the slices
  one layer ahead (LayerGather: the gather of layer i + 1 is issued, on a process group of its own,
  before layer i computes) and dropped after use, so at most two layers are whole at a time.
- Decode: on the weights as they lie (no weight moves; NVIDIA's "Helix" shape, attention over the
  sequence-sharded KV cache, the MLP tensor-parallel): attention as for whole weights
  (engine/parallel/decode_attention.py: one all-gather of the partials, merged in fp32), the MLP on the worker's
  slice with tp's all-reduce after down: two collectives a layer, as tp.
The K/V cache is `burst`'s: each worker holds its tokens' K/V for every head. ZeroLayout (at the end) is
what ModelRunner asks of these weights (engine/parallel/weight_layout.py): the vocabulary split, the layer
gatherer, the heads the K/V cache holds, the bytes to leave free, the extend attention, the short prompts
run on the slices (engine/parallel/zero_sliced.py), a row's logits, prompt logprobs' scoring.

Written on torch.distributed's collectives (all_gather_into_tensor with async_op, one process group for
the weights so that their gathers never queue behind the ring's exchanges): FSDP2's prefetching
all-gather wraps nn.Modules, and the model here is plain tensors and functions.
"""
from dataclasses import replace
from typing import Mapping

import torch
import torch.distributed as dist

from burstserve.engine.core.placement import ExtendWay, Shard
from burstserve.engine.model.config import ModelConfig
from burstserve.engine.model.model import AttendFn, LayerWeights, LlamaModel
from burstserve.engine.model.moe import ExpertWeights
from burstserve.engine.parallel.burst_attention import BurstStrategy
from burstserve.engine.parallel.decode_attention import stacked, start_all_gather
from burstserve.engine.parallel.tensor_parallel import gate_up_row_index, mlp_slices, mlp_split_refusal, sliced_mlp_config
from burstserve.engine.parallel.vocab import VocabShards, score_every_row
from burstserve.engine.parallel.weight_layout import WeightLayout, global_rank
from burstserve.engine.parallel.zero_sliced import SLICED, SlicedPrefillAttention, measure_sliced_max_tokens


class BurstZeroStrategy(BurstStrategy):
    """burst-zero: burst's prefill and K/V layout, the MLP sharded as tp shards it (the attention's weights whole)."""
    name = "burst-zero"

    @classmethod
    def option_refusal(cls, options: Mapping[str, object]) -> tuple[str, str] | None:
        """Its prefill gathers bfloat16 weights (no fp8), and runs on whole weights where decode runs on the
        MLP's slices (no chunk and decode step in one pass; mixed_batch None: auto, off here)."""
        if options["quantization"] != "none":
            return (f"burst-zero gathers bfloat16 weights; --quantization {options['quantization']} is not supported "
                    "with it", "quantization")
        if options["mixed_batch"]:
            return ("burst-zero runs a chunk on whole weights and decode on their slices, so a chunk and a decode "
                    "step cannot be one forward pass: leave --mixed-batch off", "mixed_batch")
        return super().option_refusal(options)

    def fallback_note(self, cfg: ModelConfig) -> str | None:
        """The line to log at start when the slices cannot divide this model over the workers (zero_check):
        then every worker holds the whole weights and runs as burst, rather than refusing the model."""
        reason = zero_check(cfg, self.world_size) if self.world_size > 1 else None
        return reason and f"--sp-strategy burst-zero: {reason}, so every worker holds the whole weights (as burst)"

    def sliced(self, cfg: ModelConfig) -> bool:
        """Whether the weights are sliced over the workers: more than one, and they divide cfg (zero_check)."""
        return self.world_size > 1 and zero_check(cfg, self.world_size) is None

    def weight_slices(self, cfg: ModelConfig, rank: int) -> dict[str, tuple[int, int, int]]:
        """tp's slices of the MLP (the attention's weights stay whole), and rows rank V/W .. of the embedding
        and LM head (engine/parallel/vocab.py); none when the weights stay whole (`sliced`)."""
        if not self.sliced(cfg):
            return {}
        per = cfg.vocab_size // self.world_size
        rows = (0, rank * per, (rank + 1) * per)
        vocab = {"model.embed_tokens.weight": rows} | ({} if cfg.tie_word_embeddings else {"lm_head.weight": rows})
        return mlp_slices(cfg, rank, self.world_size) | vocab

    def local_config(self, cfg: ModelConfig, rank: int) -> tuple[ModelConfig, bool]:
        """Every head, the MLP's slice; an all-reduce after down (ZeroLayout: none after o)."""
        if not self.sliced(cfg):
            return cfg, False
        return sliced_mlp_config(cfg, self.world_size), True

    def weight_layout(self, cfg: ModelConfig, rank: int, device: torch.device, group=None) -> WeightLayout:
        """Sliced weights: ZeroLayout (the MLP's slices, gathered whole for each prefill layer); else burst's."""
        if not self.sliced(cfg):
            return super().weight_layout(cfg, rank, device, group)
        return ZeroLayout(cfg, *self.local_config(cfg, rank), rank, self.world_size, device, group)


def zero_check(cfg: ModelConfig, world_size: int) -> str | None:
    """Why burst-zero cannot slice this model over world_size workers, or None: the MLPs' widths (dense and
    experts') and the vocabulary's rows must divide."""
    refusal = mlp_split_refusal(cfg, world_size, "burst-zero")
    if refusal:
        return refusal
    if cfg.vocab_size % world_size:
        return (f"burst-zero cuts the embedding and LM head by vocabulary rows; {world_size} workers do not "
                f"divide the {cfg.vocab_size} tokens")
    return None


class LayerGather:
    """The whole weights of layer i, its MLP all-gathered from every worker's tp slices (the attention's
    weights are whole already) (`layer(i)`, called for i = 0, 1, ... in order by every worker alike:
    collectives), with layer i + 1's gather started before layer i's weights are returned, so that it runs
    while layer i computes. Nothing is kept after use: at most two MLPs are whole at a time (one in use,
    one arriving)."""

    def __init__(self, cfg: ModelConfig, layers: list[LayerWeights], world_size: int, device: torch.device,
                 group=None):
        """cfg: the whole model's config; layers: this worker's slices (engine.model.LlamaModel.layers)."""
        self.cfg, self.layers, self.world_size, self.device = cfg, layers, world_size, device
        ranks = list(range(world_size)) if group is None else dist.get_process_group_ranks(group)
        # the weights' own queue (collective: all workers), beside the ring's on the data group, so that a
        # gather never waits behind the ring's exchanges; every worker issues both in the same order
        self.group = dist.new_group(ranks)
        self.gate_up_index = gate_up_row_index(cfg.intermediate_size, world_size).to(device)
        self.shared_gate_up_index = gate_up_row_index(cfg.shared_expert_intermediate_size, world_size).to(device)
        self._arriving: dict[int, tuple[list, list]] = {}    # layer -> (gathered buffers, works)

    def layer(self, i: int) -> LayerWeights:
        if i not in self._arriving:
            self._start(i)
        if i + 1 < len(self.layers) and i + 1 not in self._arriving:
            self._start(i + 1)                               # the next layer's gather, behind this one
        buffers, works = self._arriving.pop(i)
        for w in works:
            w.wait()
        return self._assemble(self.layers[i], buffers)

    def layer_alone(self, i: int) -> LayerWeights:
        """Layer i's whole weights, gathered now and nothing behind it (to time one gather; collective)."""
        self._start(i)
        buffers, works = self._arriving.pop(i)
        for w in works:
            w.wait()
        return self._assemble(self.layers[i], buffers)

    def reserve_bytes(self) -> int:
        """GPU memory a prefill's gathers take at most: three layers' MLP whole (one in use, the next
        arriving, a gathered one being put in order), for the KV pool's sizing to leave free."""
        sliced = max(sum(t.numel() * t.element_size() for t in sliced_tensors(layer)) for layer in self.layers)
        return 3 * sliced * self.world_size

    def bytes_in_flight(self) -> int:
        """Bytes of the gathers started and not yet taken (at most one layer's whole MLP)."""
        parts = [t for buffers, _ in self._arriving.values() for b in buffers for t in (b if isinstance(b, list) else [b])]
        return sum(t.numel() * t.element_size() for t in parts)

    def _start(self, i: int) -> None:
        gathered = [start_all_gather(t, self.world_size, self.group, async_op=True)
                    for t in sliced_tensors(self.layers[i])]
        self._arriving[i] = ([g for g, _ in gathered], [w for _, w in gathered])

    def _assemble(self, local: LayerWeights, buffers: list) -> LayerWeights:
        """The gathered [W, ...] MLP slices in the whole weights' layout, beside the attention's weights."""
        parts = [stacked(b) for b in buffers]
        whole = replace(local, gate_up=None, down=None, experts=None)       # attention and norms: whole already
        if local.experts is None:
            gate_up, down = parts
            return replace(whole, gate_up=self._whole_gate_up(gate_up, self.gate_up_index),  # [2 I, hidden]
                           down=down.permute(1, 0, 2).flatten(1))                            # [hidden, I]
        return replace(whole, experts=self._whole_experts(local.experts, parts))

    def _whole_experts(self, local: ExpertWeights, parts: list[torch.Tensor]) -> ExpertWeights:
        """Every expert whole from the workers' width slices: gate_up [W, E, 2 Im/W, hidden] (each slice its gate
        rows, then its up rows) -> [E, 2 Im, hidden]; down [W, E, hidden, Im/W] -> [E, hidden, Im]; the shared
        expert's as a dense MLP's. The router and the shared expert's gate are whole on every worker."""
        gate_up, down = parts[:2]
        w, e, rows, hid = gate_up.shape
        whole = replace(local, gate_up=gate_up.view(w, e, 2, rows // 2, hid).permute(1, 2, 0, 3, 4).reshape(e, w * rows, hid),
                        down=down.permute(1, 2, 0, 3).flatten(2))
        if local.shared_gate_up is not None:
            shared_gate_up, shared_down = parts[2:]
            whole.shared_gate_up = self._whole_gate_up(shared_gate_up, self.shared_gate_up_index)
            whole.shared_down = shared_down.permute(1, 0, 2).flatten(1)
        return whole

    @staticmethod
    def _whole_gate_up(gathered: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """[W, 2 I/W, hidden] stacked [gate_r; up_r] slices -> the whole [gate; up] [2 I, hidden]."""
        return gathered.flatten(0, 1).index_select(0, index)


def sliced_tensors(layer: LayerWeights) -> list[torch.Tensor]:
    """The tensors of a layer that burst-zero slices and gathers, in a fixed order: a dense MLP's gate_up and down;
    the experts' gate_up and down, then the shared expert's (engine/model/moe.py)."""
    if layer.experts is None:
        return [layer.gate_up, layer.down]
    shared = [layer.experts.shared_gate_up, layer.experts.shared_down] if layer.experts.shared_gate_up is not None else []
    return [layer.experts.gate_up, layer.experts.down] + shared


class ZeroLayout(WeightLayout):
    """burst-zero's weights on W > 1 workers (the module docstring): the attention's weights whole, tp's
    slices of the MLP (the model all-reduces after down only), the vocabulary rows of the embedding and LM
    head. A prefill's own rows run on each layer's whole weights (LayerGather) with every head, so the K/V
    cache holds every head; rows alike on every worker (decode, a "whole" extend) run on the weights as
    they lie; and so do short prompts (engine/parallel/zero_sliced.py). Logits and the embedding are
    collective calls (VocabShards)."""
    sliced_name = SLICED
    attention_sums = False               # o_proj whole: no all-reduce after it

    def __init__(self, cfg: ModelConfig, local: ModelConfig, partial_sums: bool, rank: int, world_size: int,
                 device: torch.device, group=None):
        super().__init__(cfg, local, partial_sums, rank, world_size, device, group)
        self.vocab = VocabShards(cfg.vocab_size, rank, world_size, group)
        self.attn_cfg = cfg                  # a prefill's layers are whole: every head

    def build_model(self, weights: dict[str, torch.Tensor], reduce, quantization: str,
                    kv_cache_dtype: str = "auto", fp8_attention: bool = False) -> LlamaModel:
        """The model on the slices, and its layers' gatherer (collective: it makes a process group)."""
        model = super().build_model(weights, reduce, quantization, kv_cache_dtype, fp8_attention)
        self.whole_layers = LayerGather(self.cfg, model.layers, self.world_size, self.device, self.group)
        return model

    def reserve_bytes(self) -> int:
        """The layers gathered whole (LayerGather.reserve_bytes) and the embedding table gathered whole."""
        return self.whole_layers.reserve_bytes() + self.vocab.bytes_of_whole_table(self.model.embed)

    def extend_attention(self, attend) -> tuple[AttendFn, "LayerGather | None"]:
        """A "whole" extend (the same rows on every worker) runs on the weights as they lie, as decode does,
        no weight moved; a "ring" one on whole layers, as a prefill."""
        if attend.way == ExtendWay.WHOLE:
            return attend, None
        return attend, self.whole_layers

    def sliced_limit(self, limit: int | None, share: int, ctx) -> int:
        """--zero-sliced-max-tokens `limit`; unset: measured on GPUs (collective, zero_sliced.py), none on CPU;
        at most `share`, a worker's share of max_model_len (the rows whose activations the KV pool's sizing
        leaves room for). The attention kernel is warmed up for such a prompt (a request must not pay for
        its compilation)."""
        cuda = self.device.type == "cuda"
        if limit is None:
            limit = (measure_sliced_max_tokens(self.whole_layers, self.world_size, self.device, self.model.dtype,
                                               self.group) if cuda else 0)
        limit = min(limit, share)
        if limit and cuda:
            self._warm_sliced_kernel(ctx)
        return limit

    def _warm_sliced_kernel(self, ctx) -> None:
        """One causal call of ctx.backend laid out as a sliced prompt's: q [256, H, D], k and v [256, Hkv, D],
        views of one [256, (H + 2 Hkv) D] projection output."""
        h, hkv, d = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        qkv = torch.randn(256, (h + 2 * hkv) * d, device=self.device, dtype=self.model.dtype)
        q, k, v = (t.view(256, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], dim=1))
        ctx.backend(q, k, v, True, ctx.scale)

    def prefill_on_slices(self, ctx, pool, slots: torch.Tensor, shards: list[Shard],
                          token_ids: torch.Tensor) -> torch.Tensor:
        """Every worker runs all N tokens through its weights as they lie (the MLP tensor parallel), and keeps
        its shard's K/V, every head, at slots [n] (SlicedPrefillAttention) -> the last token's logits [V], on
        every worker."""
        n = token_ids.shape[0]
        attend = SlicedPrefillAttention(pool, slots, shards[self.rank], ctx.backend, ctx.scale)
        hidden = self.model.forward(token_ids.to(self.device), torch.arange(n, device=self.device), attend)   # [N, hidden]
        return self.model.logits(hidden[-1:])[0]

    def logits_of_row(self, hidden: torch.Tensor, owner: int, row: int) -> torch.Tensor:
        """The LM head is cut by vocabulary: the row [1, hidden] is broadcast from its owner, then every
        worker's slice of the logits is gathered, on every worker."""
        one = (hidden[row:row + 1] if self.rank == owner else
               torch.empty(1, self.cfg.hidden_size, dtype=self.model.dtype, device=self.device))
        dist.broadcast(one, src=global_rank(owner, self.group), group=self.group)
        return self.model.logits(one)[0]

    def prompt_scores(self, hidden: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor, top: int,
                      replicated_kv: bool) -> list[dict]:
        """The LM head is cut by vocabulary: every worker scores every worker's rows (engine/parallel/vocab.py)."""
        return score_every_row(self.model, hidden, positions.to(self.device), token_ids, top, self.world_size,
                               self.group)

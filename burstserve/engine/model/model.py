"""The LLaMA-family decoder (LLaMA-2/3, Mistral, Qwen2, Qwen3; Qwen3-MoE, Mixtral and Qwen2-MoE, whose sparse
layers' MLP is engine/model/moe.py's experts; Gemma 3, whose layers add a norm after attention and around the
MLP), readable top to bottom. A windowed layer (ModelConfig.window) has its own RoPE base where the checkpoint
names one (Gemma 3's local layers); its window is the attention's (engine/runner/, engine/parallel/).

Attention is not computed here: `forward` takes an `attend(layer, q, k, v)` callable, so the same
model runs a sequence-parallel prefill (ring attention over shards) and a decode step over the
distributed KV cache. Tensors are [tokens, ...] with no batch dimension.
"""
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from burstserve.engine.model.config import ModelConfig
from burstserve.engine.model.moe import ExpertWeights, expert_weight_shapes, experts_mlp, take_expert_weights
from burstserve.engine.model.rope import attention_scaling, inverse_frequencies, rope_cos_sin
from burstserve.kernels import fp8, fused
from burstserve.kernels.fp8 import Fp8Weight
from burstserve.kernels.kv_quant import is_fp8, round_kv_

# attend(layer_index, q [S, H, D], k [S, Hkv, D], v [S, Hkv, D]) -> out [S, H, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class LayerWeights:
    qkv: "torch.Tensor | Fp8Weight"        # [(H + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None          # [(H + 2 Hkv) D]
    o: "torch.Tensor | Fp8Weight"          # [hidden, H D]
    gate_up: "torch.Tensor | Fp8Weight | None"    # [2 I, hidden]; None in a sparse layer
    down: "torch.Tensor | Fp8Weight | None"       # [hidden, I]
    input_norm: torch.Tensor       # [hidden]
    post_norm: torch.Tensor        # [hidden]
    q_norm: torch.Tensor | None = None    # [D] (Qwen3, Gemma 3): each head of q RMS-normed before RoPE
    k_norm: torch.Tensor | None = None    # [D] and of k
    pre_mlp_norm: torch.Tensor | None = None    # [hidden] (Gemma 3: post_norm then follows attention)
    post_mlp_norm: torch.Tensor | None = None   # [hidden]
    experts: ExpertWeights | None = None  # a sparse layer's MLP (engine/model/moe.py)


def hf_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """transformers' tensor names and shapes for this config."""
    h, d, hid, inter = cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    kvd = cfg.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, hid), "model.norm.weight": (hid,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hid)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h * d, hid), p + "self_attn.k_proj.weight": (kvd, hid),
            p + "self_attn.v_proj.weight": (kvd, hid), p + "self_attn.o_proj.weight": (hid, h * d),
            p + "input_layernorm.weight": (hid,), p + "post_attention_layernorm.weight": (hid,),
        })
        if cfg.is_sparse(i):
            shapes.update(expert_weight_shapes(cfg, i))
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, hid), p + "mlp.up_proj.weight": (inter, hid),
                           p + "mlp.down_proj.weight": (hid, inter)})
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (h * d,), p + "self_attn.k_proj.bias": (kvd,),
                           p + "self_attn.v_proj.bias": (kvd,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if cfg.gemma:
            shapes.update({p + "pre_feedforward_layernorm.weight": (hid,), p + "post_feedforward_layernorm.weight": (hid,)})
    return shapes


def gemma_norm(weight: torch.Tensor) -> torch.Tensor:
    """A Gemma RMSNorm's weight as the engine's norms take it: they scale by (1 + w), computed in fp32."""
    return (1.0 + weight.float()).to(weight.dtype)


# A prefill's MLP runs this many rows at a time (LlamaModel.mlp): large enough that its GEMMs run at full
# rate, small enough that a 64K-token chunk's gate/up output (3.5 GiB for llama3-8b) is not held whole.
MLP_PIECE_ROWS = 16384


class LlamaModel:
    """Weights and the forward pass; replicated on every worker."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, quantization: str = "none",
                 vocab=None, kv_cache_dtype: str = "auto", reduce_attention: bool = True,
                 fp8_attention: bool = False):
        """quantization "fp8": the layers' linear weights quantized at load (kernels/fp8.py). kv_cache_dtype
        "fp8": K and V rounded as the FP8 cache keeps them (kernels/kv_quant.py) before any attention, unless
        fp8_attention (--attention-backend fa3-fp8): that kernel rounds K/V to e4m3 itself, and rounding them to
        the cache's grid first would round them twice (the pages still store them rounded once). vocab
        (engine.parallel.vocab.VocabShards, burst-zero): the embedding and LM head hold this worker's
        vocabulary rows only; embedding and logits are then collective calls. reduce: the all-reduce of
        partial sums after down_proj, and after o_proj too where reduce_attention (tp; burst-zero holds the
        attention's weights whole)."""
        self.cfg = cfg
        self.device = device
        self.reduce = reduce or (lambda x: x)   # tensor parallelism: all-reduce of partial sums
        self.reduce_attention = reduce_attention
        self.vocab = vocab
        self.embed = weights.pop("model.embed_tokens.weight")
        self.norm = self._norm_weight(weights.pop("model.norm.weight"))
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights.pop("lm_head.weight")
        self.dtype = self.embed.dtype
        self.layers = [self._layer(weights, i, quantization) for i in range(cfg.num_layers)]
        # FP8 linears: the norms before q/k/v and gate/up and the silu before down write their rows
        # quantized (kernels/fp8.py: one kernel each on GPUs, the same bits as quantizing the bf16 rows
        # apart, and a quantization kernel fewer each: docs/benchmarks.md, FP8 linears)
        self.fp8_rows = quantization == "fp8"
        self.kv_fp8 = is_fp8(kv_cache_dtype) and not fp8_attention      # K/V rounded before attention
        self.inv_freq = inverse_frequencies(cfg).to(device)
        self.rope_scaling = attention_scaling(cfg)                     # YaRN's factor on cos/sin, else 1
        local = cfg.local_rope_theta is not None and cfg.has_windows      # the windowed layers' own RoPE base
        self.local_inv_freq = inverse_frequencies(
            dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)).to(device) if local else None
        # Gemma: the embedding times sqrt(hidden), rounded to the weights' dtype as transformers rounds it
        self.embed_scale = (torch.tensor(cfg.hidden_size ** 0.5, dtype=self.dtype, device=device) if cfg.gemma
                            else None)

    def _layer(self, w: dict[str, torch.Tensor], i: int, quantization: str) -> LayerWeights:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if self.cfg.qkv_bias:
            bias = torch.cat([w.pop(a + f"{x}_proj.bias") for x in "qkv"])
        linear = fp8.quantize_weight if quantization == "fp8" else (lambda t: t)
        sparse = self.cfg.is_sparse(i)
        return LayerWeights(
            qkv=linear(torch.cat([w.pop(a + f"{x}_proj.weight") for x in "qkv"])),
            qkv_bias=bias,
            o=linear(w.pop(a + "o_proj.weight")),
            gate_up=None if sparse else linear(torch.cat([w.pop(p + "mlp.gate_proj.weight"),
                                                          w.pop(p + "mlp.up_proj.weight")])),
            down=None if sparse else linear(w.pop(p + "mlp.down_proj.weight")),
            experts=take_expert_weights(self.cfg, w, i, quantization) if sparse else None,
            input_norm=self._norm_weight(w.pop(p + "input_layernorm.weight")),
            post_norm=self._norm_weight(w.pop(p + "post_attention_layernorm.weight")),
            q_norm=self._norm_weight(w.pop(a + "q_norm.weight")) if self.cfg.qk_norm else None,
            k_norm=self._norm_weight(w.pop(a + "k_norm.weight")) if self.cfg.qk_norm else None,
            pre_mlp_norm=self._norm_weight(w.pop(p + "pre_feedforward_layernorm.weight")) if self.cfg.gemma else None,
            post_mlp_norm=self._norm_weight(w.pop(p + "post_feedforward_layernorm.weight")) if self.cfg.gemma else None,
        )

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return gemma_norm(weight) if self.cfg.gemma else weight

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                seq_parallel=None, whole_layers=None) -> torch.Tensor:
        """token_ids, positions [S] -> final-normed hidden states [S, hidden]. The residual stream's
        additions ride in the next norm (kernels.fused: one kernel on GPUs). seq_parallel (tp-v3's
        engine.parallel.sequence_parallel.SequenceParallel): token_ids are this worker's rows [S / G] and
        the hidden states returned too, positions all S; gathered before the column-parallel linears,
        reduce-scattered after the row-parallel ones. whole_layers (burst-zero's
        engine.parallel.zero.LayerGather, over this model's tp slices): each layer runs with its whole
        weights, `whole_layers.layer(i)`, and every head (whole_layers.cfg), no all-reduce."""
        cfg = whole_layers.cfg if whole_layers is not None else self.cfg
        h, hkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        gather = seq_parallel.gather if seq_parallel is not None else (lambda t: t)
        reduce = seq_parallel.scatter if seq_parallel is not None else self.reduce
        if whole_layers is not None:
            reduce = lambda t: t                                       # noqa: E731  (whole weights: no partial sums)
        reduce_o = reduce if self.reduce_attention else (lambda t: t)  # burst-zero: o_proj whole
        residual = self._embed(token_ids, whole_layers is not None)   # [S, hidden]
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        cos_sin = rope_cos_sin(self.inv_freq, positions, self.dtype, self.rope_scaling)   # [S, D] each
        local_cos_sin = (rope_cos_sin(self.local_inv_freq, positions, self.dtype) if self.local_inv_freq is not None
                         else cos_sin)
        rows = self.fp8_rows and seq_parallel is None and whole_layers is None   # x as Fp8Rows (no gather of them)
        norm = fp8.rms_norm_rows if rows else fused.rms_norm
        x = norm(residual, self.layers[0].input_norm, eps) if self.layers else residual
        for i, layer in enumerate(self.layers):
            if whole_layers is not None:
                layer = whole_layers.layer(i)
            qkv = fp8.linear(gather(x), layer.qkv, layer.qkv_bias)      # [S, (H + 2 Hkv) D]
            norms = (layer.q_norm, layer.k_norm, eps) if layer.q_norm is not None else None   # Qwen3's, first
            cos, sin = local_cos_sin if cfg.window(i) is not None else cos_sin
            fused.rope_(qkv, cos, sin, h, hkv, norms)                   # q, k (normed and) rotated in place
            q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
            n = qkv.shape[0]
            k, v = k.view(n, hkv, d), v.view(n, hkv, d)
            if self.kv_fp8:          # every attention, this call's and the pages', sees the cache's values
                k, v = round_kv_(k, v)                                 # in place: one kernel on GPUs
            attn = attend(i, q.view(n, h, d), k, v)                     # [S, H, D]
            delta = reduce_o(fp8.linear(attn.reshape(attn.shape[0], h * d), layer.o))
            post_norm = fused.rms_norm if layer.experts is not None else norm   # the router reads x unquantized
            if layer.pre_mlp_norm is not None:                         # Gemma: attention's output normed first
                delta = fused.rms_norm(delta, layer.post_norm, eps)
                x, residual = post_norm(delta, layer.pre_mlp_norm, eps, residual)
            else:
                x, residual = post_norm(delta, layer.post_norm, eps, residual)
            delta = reduce(self.mlp(gather(x), layer, rows))
            if layer.post_mlp_norm is not None:
                delta = fused.rms_norm(delta, layer.post_mlp_norm, eps)
            if i + 1 < len(self.layers):
                x, residual = norm(delta, self.layers[i + 1].input_norm, eps, residual)
            else:
                x, residual = fused.rms_norm(delta, self.norm, eps, residual)
        return x if self.layers else fused.rms_norm(residual, self.norm, eps)

    def _embed(self, token_ids: torch.Tensor, own_rows: bool) -> torch.Tensor:
        """token_ids [S] -> [S, hidden]. With the vocabulary cut over the workers: a prefill's own rows
        (own_rows, different on every worker) look up the table gathered whole; rows alike on every
        worker (a decode step) are looked up in each worker's rows and summed."""
        if self.vocab is None:
            return F.embedding(token_ids, self.embed)
        if own_rows:
            return F.embedding(token_ids, self.vocab.whole_table(self.embed))
        return self.vocab.embed(token_ids, self.embed)

    def mlp(self, x: "torch.Tensor | fp8.Fp8Rows", layer: LayerWeights, rows: bool = False) -> torch.Tensor:
        """x [S, hidden] -> [S, hidden], MLP_PIECE_ROWS rows at a time: gate/up and silu*up ([rows, 3 I])
        are a prefill's largest activations, and the KV pool is sized for one piece of them
        (engine/pages/sizing.py). rows: the down projection's input made as Fp8Rows (see fp8_rows)."""
        n = x.shape[0]
        if n <= MLP_PIECE_ROWS:
            return self._mlp(x, layer, rows)
        out = None
        for start in range(0, n, MLP_PIECE_ROWS):
            stop = min(start + MLP_PIECE_ROWS, n)
            piece = self._mlp(fp8.row_range(x, start, stop), layer, rows)                  # [stop - start, hidden]
            if out is None:
                out = piece.new_empty(n, piece.shape[1])
            out[start:stop] = piece
        return out

    def _mlp(self, x: "torch.Tensor | fp8.Fp8Rows", layer: LayerWeights, rows: bool) -> torch.Tensor:
        if layer.experts is not None:
            return experts_mlp(x, layer.experts)
        if self.cfg.gemma:                                           # GeGLU: tanh GELU of gate, times up
            gate, up = fp8.linear(x, layer.gate_up).chunk(2, dim=-1)
            return fp8.linear(F.gelu(gate, approximate="tanh") * up, layer.down)
        act = fp8.silu_and_mul_rows if rows else fused.silu_and_mul
        return fp8.linear(act(fp8.linear(x, layer.gate_up)), layer.down)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> logits [B, vocab] fp32 (with the vocabulary cut over the workers: a collective
        call, hidden the same on every worker)."""
        if self.vocab is not None:
            return self.vocab.logits(hidden, self.lm_head)
        return F.linear(hidden, self.lm_head).float()

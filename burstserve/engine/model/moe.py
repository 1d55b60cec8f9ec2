"""A mixture of experts' MLP (Qwen3-MoE, Mixtral, Qwen2-MoE), as transformers computes it.

The router picks each token's top-k experts from the softmax of its logits (fp32; on the CPU torch.topk: ties
break as transformers breaks them; on CUDA one kernel, kernels/moe_route.py, the lower index first at a tie, as
torch.topk there); the chosen weights are renormalized where the model says so. Each expert is a
SwiGLU MLP run on the rows routed to it, its output times the row's routing weight, summed into the row:
on the CPU in expert order (transformers' index_add order), on a GPU in the row's choices' order: a decode step's
few rows in kernels that read only the chosen experts (kernels/moe_few_rows.py), more rows as grouped GEMMs
(grouped_experts). Qwen2-MoE adds a shared expert every row takes, behind a
sigmoid gate.

With `--quantization fp8` (vLLM's meaning, kernels/fp8.py's for dense linears) each expert's gate_up and down are
FP8 with one fp32 scale per expert per output row (Fp8Experts: kernels/fp8.quantize_weight's rule, expert by
expert), and every expert GEMM quantizes its input rows per token: the routed rows (a row's copies quantize alike:
x can be quantized once) and each choice's silu*up row. The sums are fp32, both scales applied to them. The router and the
shared expert's sigmoid gate stay in the model's dtype (vLLM keeps the gate unquantized); the shared expert's
linears are dense FP8 linears. The same quantization points on every path: the CPU's per-expert fp8.linear (the
reference), the few-rows kernels and torch._scaled_grouped_mm.

The experts' feed-forward is local to a token: under context parallelism each worker routes its own rows
to experts it holds whole, and nothing is exchanged beyond what attention exchanges. Where the strategy slices
the weights (tp, tp-v3, burst-zero: `expert_slices`), every expert is cut by width as tp cuts a dense MLP: each
worker holds rows r Im/W .. of every expert's gate and up and the same columns of its down (the router whole),
routes every row it runs, and its weighted sum is a partial sum that the model's all-reduce after the MLP
completes (the routing weights and the shared expert's sigmoid gate scale each partial alike).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from burstserve.engine.model.config import ModelConfig
from burstserve.kernels import fp8, fused, moe_grouped
from burstserve.kernels.fp8 import Fp8Weight
from burstserve.kernels.moe_few_rows import experts_few_rows
from burstserve.kernels.moe_route import route_top_k


@dataclass
class Fp8Experts:
    """Every expert's weight [E, N, K] in FP8 and its per-output-row scales, one set an expert."""
    weight: torch.Tensor                     # [E, N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor                      # [E, N] fp32: weight[e, n] * scale[e, n] is expert e's row n

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def expert(self, e: int) -> Fp8Weight:
        """Expert e's weight as kernels/fp8.py's dense linears take it (views, no copy)."""
        return Fp8Weight(self.weight[e], self.scale[e][None])


def quantize_experts(per_expert: list[torch.Tensor]) -> Fp8Experts:
    """Each expert's [N, K] weight quantized as fp8.quantize_weight quantizes a dense one, stacked."""
    quantized = [fp8.quantize_weight(w) for w in per_expert]
    weight = torch.stack([q.weight.view(torch.uint8) for q in quantized]).view(fp8.FP8)   # (stacked as bytes)
    return Fp8Experts(weight, torch.cat([q.scale for q in quantized]))


@dataclass
class ExpertWeights:
    router: torch.Tensor                     # [E, hidden]: never quantized
    gate_up: "torch.Tensor | Fp8Experts"     # [E, 2 Im, hidden]: each expert's gate rows, then its up rows
    down: "torch.Tensor | Fp8Experts"        # [E, hidden, Im]
    top_k: int
    renormalize: bool                        # the chosen weights divided by their sum
    weights_fp32: bool                       # Mixtral: the routing weights stay fp32 in the combine
    shared_gate_up: "torch.Tensor | Fp8Weight | None" = None   # [2 Is, hidden] (Qwen2-MoE)
    shared_down: "torch.Tensor | Fp8Weight | None" = None      # [hidden, Is]
    shared_gate: torch.Tensor | None = None      # [1, hidden]: sigmoid(x . g) scales the shared expert's output


def expert_weight_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """transformers' tensor names and shapes of one sparse layer's MLP (the checkpoints' per-expert names)."""
    hid, inter, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    if cfg.expert_names == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe."
        shapes = {p + "gate.weight": (n, hid)}
        for j in range(n):
            e = f"{p}experts.{j}."
            shapes.update({e + "w1.weight": (inter, hid), e + "w3.weight": (inter, hid), e + "w2.weight": (hid, inter)})
        return shapes
    p = f"model.layers.{layer}.mlp."
    shapes = {p + "gate.weight": (n, hid)}
    for j in range(n):
        e = f"{p}experts.{j}."
        shapes.update({e + "gate_proj.weight": (inter, hid), e + "up_proj.weight": (inter, hid),
                       e + "down_proj.weight": (hid, inter)})
    if cfg.shared_expert_intermediate_size:
        shared = cfg.shared_expert_intermediate_size
        shapes.update({p + "shared_expert.gate_proj.weight": (shared, hid), p + "shared_expert.up_proj.weight": (shared, hid),
                       p + "shared_expert.down_proj.weight": (hid, shared), p + "shared_expert_gate.weight": (1, hid)})
    return shapes


# the checkpoints' per-expert tensors tp cuts by rows (gate and up) and by columns (down)
ROW_SLICED = ("gate_proj.weight", "up_proj.weight", "w1.weight", "w3.weight")
COLUMN_SLICED = ("down_proj.weight", "w2.weight")


def expert_slices(cfg: ModelConfig, layer: int, rank: int, world_size: int) -> dict[str, tuple[int, int, int]]:
    """Worker `rank`'s part of one sparse layer's MLP, name -> (dim, start, stop): rows rank Im/W .. of every
    expert's gate and up, the same columns of its down, and so of the shared expert's (its width Is); the router
    and the shared expert's gate are read whole."""
    slices = {}
    for name in expert_weight_shapes(cfg, layer):
        dim = 0 if name.endswith(ROW_SLICED) else 1 if name.endswith(COLUMN_SLICED) else None
        if dim is None:
            continue
        width = cfg.shared_expert_intermediate_size if ".shared_expert." in name else cfg.moe_intermediate_size
        per = width // world_size
        slices[name] = (dim, rank * per, (rank + 1) * per)
    return slices


def take_expert_weights(cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int,
                        quantization: str = "none") -> ExpertWeights:
    """One sparse layer's weights, popped from the checkpoint's tensors and stacked by expert; quantization "fp8":
    the experts' and the shared expert's linears in FP8 (the router and the shared expert's gate as they are)."""
    n = cfg.num_experts
    if cfg.expert_names == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe."
        gate, up, down = "w1", "w3", "w2"
    else:
        p = f"model.layers.{layer}.mlp."
        gate, up, down = "gate_proj", "up_proj", "down_proj"
    quantized = quantization == "fp8"
    stack = quantize_experts if quantized else torch.stack
    linear = fp8.quantize_weight if quantized else (lambda t: t)
    router = w.pop(p + "gate.weight")
    gate_up = stack([torch.cat([w.pop(f"{p}experts.{j}.{gate}.weight"), w.pop(f"{p}experts.{j}.{up}.weight")])
                     for j in range(n)])
    downs = stack([w.pop(f"{p}experts.{j}.{down}.weight") for j in range(n)])
    experts = ExpertWeights(router=router, gate_up=gate_up, down=downs, top_k=cfg.num_experts_per_tok,
                            renormalize=cfg.norm_topk_prob, weights_fp32=cfg.router_weights_fp32)
    if cfg.shared_expert_intermediate_size:
        s = p + "shared_expert."
        experts.shared_gate_up = linear(torch.cat([w.pop(s + "gate_proj.weight"), w.pop(s + "up_proj.weight")]))
        experts.shared_down = linear(w.pop(s + "down_proj.weight"))
        experts.shared_gate = w.pop(p + "shared_expert_gate.weight")
    return experts


def route(x: torch.Tensor, experts: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """x [S, hidden] -> (the routing weights [S, k], fp32 or x's dtype as the model keeps them; the experts
    [S, k] int64), as transformers' TopKRouter computes them."""
    out_dtype = torch.float32 if experts.weights_fp32 else x.dtype
    return route_top_k(F.linear(x, experts.router), experts.top_k, experts.renormalize, out_dtype)


def experts_mlp(x: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
    """x [S, hidden] -> [S, hidden]: the routed experts' weighted sum, plus the shared expert where there is one."""
    weights, chosen = route(x, experts)                                      # [S, k] each
    out = _few_rows(x, experts, weights, chosen) if x.is_cuda else None
    if out is None:                                                          # more than a decode step's few rows
        out = _many_rows(x, experts, weights, chosen)
    if experts.shared_gate_up is not None:
        shared = _swiglu(x, experts.shared_gate_up, experts.shared_down)
        out = out + torch.sigmoid(F.linear(x, experts.shared_gate)) * shared
    return out


def _swiglu(x: torch.Tensor, gate_up: "torch.Tensor | Fp8Weight", down: "torch.Tensor | Fp8Weight") -> torch.Tensor:
    """x [R, hidden] -> [R, hidden]: one expert's MLP, as the dense MLP computes it (FP8: each input quantized per
    token, silu*up as it is made: one kernel on GPUs)."""
    act = fp8.silu_and_mul_rows if isinstance(down, Fp8Weight) else fused.silu_and_mul
    return fp8.linear(act(fp8.linear(x, gate_up)), down)


def _expert(weights: "torch.Tensor | Fp8Experts", e: int) -> "torch.Tensor | Fp8Weight":
    return weights.expert(e) if isinstance(weights, Fp8Experts) else weights[e]


def _few_rows(x: torch.Tensor, experts: ExpertWeights, weights: torch.Tensor,
              chosen: torch.Tensor) -> torch.Tensor | None:
    gate_up, down = experts.gate_up, experts.down
    if isinstance(gate_up, Fp8Experts):
        return experts_few_rows(x, gate_up.weight, down.weight, weights, chosen, gate_up_scale=gate_up.scale,
                                down_scale=down.scale)
    return experts_few_rows(x, gate_up, down, weights, chosen)


def _many_rows(x: torch.Tensor, experts: ExpertWeights, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    quantized = isinstance(experts.gate_up, Fp8Experts)
    if quantized and scaled_grouped_gemm_runs(x, experts):
        return grouped_fp8_experts(x, experts, weights, chosen)             # no host read-back: graphs too
    if not quantized and grouped_gemm_runs(x):
        return grouped_experts(x, experts, weights, chosen)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return every_expert(x, experts, weights, chosen)                    # a CUDA graph: no host read-back
    return routed_experts(x, experts, weights, chosen)


def routed_experts(x: torch.Tensor, experts: ExpertWeights, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each expert on the rows routed to it: the [S k] choices sorted by expert once (the counts read back to the
    host), each expert then running on its contiguous run of rows, its weighted output added to them. FP8 experts
    run as dense FP8 linears (kernels/fp8.linear): the CPU's path and the reference of the others."""
    top_k = chosen.shape[1]
    flat = chosen.flatten()                                                  # [S k]: row r's choices at r k ..
    order = torch.argsort(flat, stable=True)                                 # by expert, then by row
    rows = order // top_k                                                    # [S k] the token of each sorted slot
    counts = torch.bincount(flat, minlength=experts.gate_up.shape[0]).tolist()
    routed = x[rows]                                                         # [S k, hidden]
    slot_weights = weights.flatten()[order]
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        stop = start + count
        y = _swiglu(routed[start:stop], _expert(experts.gate_up, e), _expert(experts.down, e))
        out.index_add_(0, rows[start:stop], (y * slot_weights[start:stop, None]).to(out.dtype))
        start = stop
    return out


def grouped_gemm_runs(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM (CUTLASS, Hopper and newer, bfloat16) takes these rows."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def scaled_grouped_gemm_runs(x: torch.Tensor, experts: ExpertWeights) -> bool:
    """Whether torch's FP8 grouped GEMM (CUTLASS, row-wise scales, bfloat16 out) takes these rows: some, compute
    capability 9.x or 10.x (torch's own check), every GEMM's K and N multiples of 16."""
    hidden, im = experts.down.shape[1], experts.down.shape[2]
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] > 0 and hasattr(torch, "_scaled_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] in (9, 10) and hidden % 16 == 0 and im % 16 == 0)


def _sorted_choices(chosen: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """chosen [S, k] -> (order [S k]: sorted slot -> choice, by expert then row; offsets [E] int32: each expert's
    group end), on the device (no host read-back). The keys are sorted as int32 (half the radix passes)."""
    flat = chosen.flatten().to(torch.int32)                                  # [S k]
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=chosen.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, torch.cumsum(counts, 0, dtype=torch.int32)


def _sum_choices(y: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """y [S k, hidden] in sorted order -> [S, hidden] in y's dtype: each row's k outputs summed in its choices'
    order (fp32 sums, one rounding; kernels/moe_grouped.py)."""
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel(), device=order.device)          # choice -> sorted slot
    return moe_grouped.sum_choices(y, slot, top_k)


def grouped_experts(x: torch.Tensor, experts: ExpertWeights, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The experts as two grouped GEMMs over the [S k] choices sorted by expert (gate/up, then down), the group
    boundaries computed on the GPU (no host read-back, so a CUDA graph can replay it; an expert no row chose is an
    empty group, its weights not read). Each choice's routing weight scales its silu*up row before down (down is
    linear: the same product, on the narrower rows); each row's k outputs are gathered back and summed."""
    top_k = chosen.shape[1]
    order, offsets = _sorted_choices(chosen, experts.gate_up.shape[0])
    routed = x[order // top_k]                                               # [S k, hidden]
    up = torch._grouped_mm(routed, experts.gate_up.transpose(-2, -1), offs=offsets)        # [S k, 2 Im]
    act = moe_grouped.silu_mul_scaled(up, weights.flatten()[order])         # [S k, Im]
    y = torch._grouped_mm(act, experts.down.transpose(-2, -1), offs=offsets)               # [S k, hidden]
    return _sum_choices(y, order, top_k).to(x.dtype)


def grouped_fp8_experts(x: torch.Tensor, experts: ExpertWeights, weights: torch.Tensor,
                        chosen: torch.Tensor) -> torch.Tensor:
    """grouped_experts for FP8 experts, in torch._scaled_grouped_mm: A [S k, K] e4m3 with one fp32 scale a row,
    B [E, K, N] e4m3 (each expert's rows, column-major) with one a column per expert, offs int32 group ends, bf16
    out. The routed rows are x quantized per token (once: a row's copies alike), the silu*up rows quantized per
    choice as they are made; each choice's routing weight is folded into its silu*up row's scale (the GEMM's fp32
    epilogue applies it: the quantized rows stay those of the unweighted product, as on the other paths)."""
    top_k = chosen.shape[1]
    gate_up, down = experts.gate_up, experts.down
    order, offsets = _sorted_choices(chosen, gate_up.shape[0])
    xq, xs = fp8.quantize_rows(x)                                            # [S, hidden] e4m3, [S, 1] fp32
    rows = order // top_k                                                    # [S k] the token of each sorted slot
    routed = xq.view(torch.uint8)[rows].view(fp8.FP8)                        # [S k, hidden], gathered as bytes
    up = torch._scaled_grouped_mm(routed, gate_up.weight.transpose(-2, -1), xs[rows, 0], gate_up.scale,
                                  offs=offsets, out_dtype=torch.bfloat16)   # [S k, 2 Im]
    act = fp8.silu_and_mul_rows(up)                                          # [S k, Im] e4m3, [S k, 1]
    scale = act.scale[:, 0] * weights.flatten()[order].float()              # [S k]
    y = torch._scaled_grouped_mm(act.values, down.weight.transpose(-2, -1), scale, down.scale,
                                 offs=offsets, out_dtype=torch.bfloat16)    # [S k, hidden]
    return _sum_choices(y, order, top_k).to(x.dtype)


def every_expert(x: torch.Tensor, experts: ExpertWeights, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The same sum with shapes fixed by S alone (what a CUDA graph can replay): every expert runs on every row,
    weighted by the row's routing weight for it, 0 where the row did not choose it. E / k times the FLOPs, and
    every expert's weights read: the fallback of a graph where neither the few-row kernels nor a grouped GEMM runs."""
    dense = torch.zeros(x.shape[0], experts.gate_up.shape[0], dtype=weights.dtype, device=x.device)
    dense.scatter_(1, chosen, weights)                                       # [S, E]
    out = torch.zeros_like(x)
    for e in range(experts.gate_up.shape[0]):
        y = _swiglu(x, _expert(experts.gate_up, e), _expert(experts.down, e))
        out += (y * dense[:, e:e + 1]).to(out.dtype)
    return out


def piece_elements_per_row(cfg: ModelConfig) -> int:
    """Elements a sparse layer's MLP holds per row of the piece it runs (engine/pages/sizing.py): the routed
    copies of the row, each chosen expert's gate/up and silu*up and its weighted output, the router's fp32
    probabilities (two elements each of a 16-bit dtype, a bound), and the shared expert's gate/up."""
    if not cfg.num_experts:
        return 0
    k, hid, inter = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    return k * (2 * hid + 3 * inter) + 2 * cfg.num_experts + 3 * cfg.shared_expert_intermediate_size + hid

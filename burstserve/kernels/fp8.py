"""FP8 linear layers (`--quantization fp8`, vLLM's meaning): weights quantized once at load to
float8_e4m3fn with one scale per output channel, activations quantized on the fly with one scale per
token, both scales applied by the GEMM itself (torch._scaled_mm's row-wise scaling, the tensor cores' own
sums, bf16 out; for a decode step's few rows the same product in kernels/fp8_small_gemm.py's Triton kernels,
their sums moved into fp32 every 128 products).
Attention, norms, embeddings and the LM head stay in bf16.

    w_fp8[n, k] = w[n, k] / s_w[n],   s_w[n] = max_k |w[n, k]| / 448
    x_fp8[m, k] = x[m, k] / s_x[m],   s_x[m] = max_k |x[m, k]| / 448
    y[m, n] = s_x[m] s_w[n] sum_k x_fp8[m, k] w_fp8[n, k]   (+ bias[n])
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from burstserve.kernels import fp8_small_gemm, fused
from burstserve.kernels.device import below_fp8_capability

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                    # the largest finite float8_e4m3fn
MIN_SCALE = 1e-12                  # an all-zero row's scale (its values stay 0)
QUANTIZATIONS = ("none", "fp8")


@dataclass
class Fp8Weight:
    """A linear weight [N, K] in FP8 and its per-output-channel scales."""
    weight: torch.Tensor           # [N, K] float8_e4m3fn, row-major (its .t() is the column-major operand)
    scale: torch.Tensor            # [1, N] fp32

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape


@dataclass
class Fp8Rows:
    """Activations [M, K] already quantized per token, by the kernel that computed them (rms_norm_rows,
    silu_and_mul_rows): what `linear` would have made of the bf16 rows, without their round trip."""
    values: torch.Tensor           # [M, K] float8_e4m3fn
    scale: torch.Tensor            # [M, 1] fp32
    dtype: torch.dtype             # the rows' own dtype, the GEMM's output

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def row_range(x: "torch.Tensor | Fp8Rows", start: int, stop: int) -> "torch.Tensor | Fp8Rows":
    """Rows start..stop-1 of x [M, K], as a view (Fp8Rows: its values and scales)."""
    if isinstance(x, Fp8Rows):
        return Fp8Rows(x.values[start:stop], x.scale[start:stop], x.dtype)
    return x[start:stop]


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """w [N, K] (bf16/fp32) -> its FP8 copy and scales."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)          # [N]
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(q.contiguous(), scale[None, :].contiguous())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scales [M, 1] fp32): one scale per token, from its largest value. In
    x's dtype (a 128K-token prefill's MLP input in fp32 would be 7.5 GB more): x times 448 / amax rounded
    to x's dtype lands within 0.4% of 448, under 464 where float8_e4m3fn would overflow, and the scale
    returned is that rounded factor's exact inverse. On GPUs one Triton kernel (kernels/fused.py), in fp32."""
    triton_result = fused.quantize_fp8_rows(x)
    if triton_result is not None:
        return triton_result
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=MIN_SCALE * FP8_MAX)      # [M, 1]
    inverse = (FP8_MAX / amax).to(x.dtype)                                                # [M, 1]
    return (x * inverse).to(FP8), 1.0 / inverse.float()


def linear(x: "torch.Tensor | Fp8Rows", w: "torch.Tensor | Fp8Weight", bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a bf16 weight; for an Fp8Weight, x [..., K] quantized per token (Fp8Rows [M, K]: as they
    are) and one scaled GEMM -> [..., N] in x's dtype."""
    if isinstance(x, Fp8Rows):
        return scaled_mm(x.values, x.scale, w, bias, x.dtype)
    if not isinstance(w, Fp8Weight):
        return F.linear(x, w, bias)
    rows = x.reshape(-1, x.shape[-1])                                              # [M, K]
    xq, xs = quantize_rows(rows)
    out = scaled_mm(xq, xs, w, bias, x.dtype)
    return out.reshape(*x.shape[:-1], w.weight.shape[0])


def scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = s_x s_w (xq @ w^T) (+ bias) in dtype: for a few rows (decode steps) the Triton kernels of
    kernels/fp8_small_gemm.py, which read the weight at the memory's rate, else torch._scaled_mm."""
    out = fp8_small_gemm.scaled_mm_few_rows(xq, xs, w, bias, dtype)
    if out is not None:
        return out
    # the tensor cores' own sums (use_fast_accum, as vLLM's CUTLASS FP8 GEMMs on sm_90): 7% faster than sums
    # moved into fp32 every 128 products; their error (0.2-0.3%) is a tenth of the operands' e4m3 rounding (3.7%)
    return torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.scale, bias=bias, out_dtype=dtype,
                            use_fast_accum=True)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """fused.rms_norm whose output only feeds FP8 linears -> its Fp8Rows (with a residual: (rows, x +
    residual)): one kernel on GPUs, the normed rows never written in bf16; else the norm, then quantize_rows.
    The same bits either way."""
    made = fused.rms_norm_fp8(x, weight, eps, residual)
    if made is not None:
        rows = Fp8Rows(made[0], made[1], x.dtype)
        return rows if residual is None else (rows, made[2])
    normed = fused.rms_norm(x, weight, eps, residual)
    out = normed if residual is None else normed[0]
    rows = Fp8Rows(*quantize_rows(out), out.dtype)
    return rows if residual is None else (rows, normed[1])


def silu_and_mul_rows(gate_up: torch.Tensor) -> Fp8Rows:
    """fused.silu_and_mul whose output feeds an FP8 linear -> its Fp8Rows (one kernel on GPUs)."""
    made = fused.silu_and_mul_fp8(gate_up)
    if made is not None:
        return Fp8Rows(made[0], made[1], gate_up.dtype)
    out = fused.silu_and_mul(gate_up)
    return Fp8Rows(*quantize_rows(out), out.dtype)


def quantization_refusal(quantization: str, devices: list[str], dtype: str) -> str | None:
    """Why this quantization cannot run on these devices in this dtype, or None."""
    if quantization not in QUANTIZATIONS:
        return f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}"
    if quantization == "none":
        return None
    if not all(d.startswith("cuda") for d in devices):
        return ("--quantization fp8 needs CUDA GPUs with FP8 tensor cores (compute capability 8.9 or newer: "
                f"Ada, Hopper, Blackwell); the devices are {', '.join(devices)}")
    if dtype != "bfloat16":
        return f"--quantization fp8 computes in bfloat16 (its GEMMs' output); --dtype {dtype} cannot be used with it"
    return below_fp8_capability(devices, "--quantization fp8 needs FP8 tensor cores")



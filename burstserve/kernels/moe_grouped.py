"""The elementwise steps around the grouped experts' two GEMMs (engine/model/moe.grouped_experts: a prefill's rows,
their [S k] choices sorted by expert), one kernel each on CUDA (Triton), torch ops elsewhere.

    silu_mul_scaled(up [R, 2 Im], scale [R]) -> [R, Im] in up's dtype: silu(gate) * up * scale, gate and up the
        halves of each row, the product in fp32 and rounded once (R = S k sorted choices; scale: each choice's
        routing weight, which down, being linear, may take on its narrower input)
    sum_choices(y [S k, hidden], slot [S k] | None, k, out_dtype=None) -> [S, hidden] in out_dtype (default y's):
        out[r] = sum over j < k of y[slot[r k + j]] (slot: where each row's j-th choice sits in the sorted order;
        None: in choice order already, a decode step's few rows), fp32 sums in j's order, rounded once

Why: as torch ops the first is two passes over the [S k, Im] rows (silu*up, then the scaling with its gathered
weights) and the second a gather of all [S k, hidden] rows into choice order before a sum reads them again; each
kernel here reads its input once. At a prefill's 16,384-row pieces these passes were a third of the experts' time
(docs/benchmarks.md, mixtures of experts). The torch ops compute the same: the Triton kernels differ from them by
fp32 summation order only. A kernel that fails to build or launch logs once and the torch ops serve from then on
(kernels/triton_setup.py).
"""
import torch
import torch.nn.functional as F

from burstserve.kernels.arith import ceil_div
from burstserve.kernels.triton_setup import LazyTriton

tl = None   # triton.language, bound by _build (the kernels resolve it as a global)
BLOCK = 1024


def silu_mul_scaled(up: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    kern = _triton.kernels(up.device)
    if kern is not None and up.shape[0] > 0:
        try:
            return _silu_mul_scaled_triton(kern["silu_mul_scaled"], up, scale)
        except Exception as e:
            _triton.failed(e)
    gate, val = up.float().chunk(2, dim=-1)
    return (F.silu(gate) * val * scale.float()[:, None]).to(up.dtype)


def sum_choices(y: torch.Tensor, slot: torch.Tensor | None, k: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    out_dtype = out_dtype or y.dtype
    kern = _triton.kernels(y.device)
    if kern is not None and y.shape[0] > 0:
        try:
            return _sum_choices_triton(kern["sum_choices"], y, slot, k, out_dtype)
        except Exception as e:
            _triton.failed(e)
    by_row = (y if slot is None else y[slot]).view(-1, k, y.shape[1])
    return by_row.sum(dim=1).to(out_dtype)                      # torch sums a 16-bit dtype in fp32 too


def _build() -> dict:
    """jit the kernels (a fresh set each call: the CPU tests build interpreted ones)."""
    global tl
    import triton
    import triton.language as tl

    def silu_mul_scaled_kernel(up_ptr, scale_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        """Program = one row's block of Im columns: silu(gate) * up * scale in fp32, one rounding."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(up_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        val = tl.load(up_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(scale_ptr + row).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * val * s
        tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    def sum_choices_kernel(y_ptr, slot_ptr, out_ptr, hidden, K: tl.constexpr, BLOCK: tl.constexpr,
                           SLOTS: tl.constexpr):
        """Program = one row's block of hidden columns: its K choices' rows summed in fp32, in j's order (SLOTS:
        found through slot, else rows r K + j)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(K):
            if SLOTS:
                src = tl.load(slot_ptr + row * K + j).to(tl.int64)
            else:
                src = row * K + j
            acc += tl.load(y_ptr + src * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return {"silu_mul_scaled": triton.jit(silu_mul_scaled_kernel), "sum_choices": triton.jit(sum_choices_kernel)}


_triton = LazyTriton(_build, "moe_grouped")


def _silu_mul_scaled_triton(kernel, up, scale):
    up, scale = up.contiguous(), scale.contiguous()
    rows, inter = up.shape[0], up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=up.dtype, device=up.device)
    kernel[(rows, ceil_div(inter, BLOCK))](up, scale, out, inter, BLOCK=BLOCK)
    return out


def _sum_choices_triton(kernel, y, slot, k, out_dtype=None):
    y = y.contiguous()
    slots = slot is not None
    slot = slot.contiguous() if slots else y                    # (unread without SLOTS)
    rows, hidden = y.shape[0] // k, y.shape[1]
    out = torch.empty(rows, hidden, dtype=out_dtype or y.dtype, device=y.device)
    kernel[(rows, ceil_div(hidden, BLOCK))](y, slot, out, hidden, K=k, BLOCK=BLOCK, SLOTS=slots)
    return out

"""FP8 linear layers for a few rows (a decode step's M <= 64): the product kernels/fp8.py asks of
torch._scaled_mm, in Triton kernels that read the weight at the memory's rate.

    scaled_mm_few_rows(x_fp8 [M, K], s_x [M, 1], w: Fp8Weight ([N, K], s_w [1, N]), bias [N] | None, dtype)
        -> y [M, N] in dtype, y[m, n] = s_x[m] s_w[n] sum_k x_fp8[m, k] w_fp8[n, k] (+ bias[n]),
           or None where these kernels do not apply (the caller runs torch._scaled_mm)

Why: at a decode step's M the GEMM is its weight's bytes, and cuBLAS's FP8 kernel there tiles 128 x 128
outputs with K whole, so llama3-8b's 4096- and 6144-wide outputs make 32-48 programs for 132 SMs: the FP8
weights streamed at well under the memory's rate, slower than bf16's split-K GEMVs over twice the bytes.

How:
- operands swapped: acc^T [BLOCK_N, BLOCK_M] = W tile [BLOCK_N, BLOCK_K] @ x tile^T, so the weight's rows
  are the warp-group MMA's 64-row side and x's few rows (padded to 16) its narrow side; both are read
  K-major from shared memory as FP8 (no conversion; fp32 accumulate, the MMAs' own sums moved into
  fp32 every 128 products).
- K cut into SPLIT runs when the outputs alone would not fill the SMs `waves` times; each run's fp32
  partial goes to part [SPLIT, M, N] and a second kernel sums them, applies the scales and the bias and
  casts (a fixed order: the same bits every call). Unsplit, the first kernel does that itself. (Summing in
  the run that finishes last instead, one launch fewer, measured no faster at one row and slower at 64.)
Shapes the kernels take: M <= 64, N a multiple of BLOCK_N, K of BLOCK_K (llama-family layers are).

Triton's interpreter (TRITON_INTERPRET=1) runs the same kernels on the CPU
(tests/kernels/test_fp8_small_gemm.py), its FP8 dot in full precision.
"""
import torch

from burstserve.kernels.arith import ceil_div, next_pow2
from burstserve.kernels.device import num_sms
from burstserve.kernels.triton_setup import LazyTriton

tl = None                  # triton.language, bound by _build (the kernels resolve it as a global)
scaled_store = None        # the kernel's epilogue, jitted by _build (resolved as a global too)

MAX_ROWS = 64              # above this, cuBLAS's GEMM (the weight is read once per 128 rows anyway)
MIN_K_TILES = 4            # a split runs at least this many K tiles (fewer: its pipeline never fills)
MAX_SPLIT = 16


def scaled_mm_few_rows(xq: torch.Tensor, xs: torch.Tensor, w, bias: torch.Tensor | None, dtype: torch.dtype
                       ) -> torch.Tensor | None:
    """See the module docstring."""
    if xq.shape[0] > MAX_ROWS or xq.shape[0] == 0:
        return None
    kern = _triton.kernels(xq.device)
    if kern is None:
        return None
    try:
        return _launch(kern, xq, xs, w.weight, w.scale, bias, dtype)
    except Exception as e:          # compile or launch failure: cuBLAS from now on
        _triton.failed(e)
        return None


def choose_split(n_tiles: int, k_tiles: int, num_sms: int, waves: int) -> int:
    """K runs per output tile: enough programs for `waves` programs an SM, each run >= MIN_K_TILES tiles."""
    wanted = ceil_div(waves * num_sms, n_tiles)
    return max(1, min(wanted, k_tiles // MIN_K_TILES, MAX_SPLIT))


def _launch(kern, xq, xs, w, ws, bias, dtype, block_n=64, block_k=256, stages=3, warps=4, waves=3):
    """The launch's defaults are the fastest measured at decode shapes (docs/benchmarks.md, "FP8 linears"); the
    tests pass smaller blocks to cover K splits on small shapes, scripts/hopper_codegen.py compiles these."""
    m, k = xq.shape
    n = w.shape[0]
    unit_strides = [xq.stride(1), w.stride(1), xs.stride(0), ws.stride(-1)] + ([] if bias is None else [bias.stride(0)])
    if n % block_n or k % block_k or any(st != 1 for st in unit_strides):
        return None
    block_m = max(16, next_pow2(m))
    k_tiles = k // block_k
    split = choose_split(n // block_n, k_tiles, _num_sms(xq.device), waves)
    per = ceil_div(k_tiles, split)                      # K tiles a run
    split = ceil_div(k_tiles, per)                      # no empty run
    out = torch.empty(m, n, dtype=dtype, device=xq.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=xq.device) if split > 1 else out
    has_bias = bias is not None
    bias_arg = bias if has_bias else ws
    kern["gemm"][(n // block_n, split)](
        xq.view(torch.uint8), xs, w.view(torch.uint8), ws, bias_arg, out, part, m, n, k, xq.stride(0), w.stride(0),
        per * block_k, HAS_BIAS=has_bias, SPLIT=split > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, num_warps=warps)
    if split > 1:
        block = min(1024, next_pow2(n))
        kern["reduce"][(m, ceil_div(n, block))](part, xs, ws, bias_arg, out, m, n, SPLIT=split, HAS_BIAS=has_bias,
                                                 BLOCK=block, num_warps=4)
    return out


def _num_sms(device: torch.device) -> int:
    """The device's SM count (the interpreter on the CPU: any count)."""
    return num_sms(device) if device.type == "cuda" else 4


def _build() -> dict:
    """jit the two kernels. A fresh set each call: tests build interpreted ones (TRITON_INTERPRET=1)."""
    global tl
    import triton
    import triton.language as tl

    def scaled_store_fn(acc, xs_ptr, ws_ptr, bias_ptr, out_ptr, rows, cols, row_ok, N, HAS_BIAS: tl.constexpr):
        """out[rows, cols] = s_x[rows] s_w[cols] acc^T (+ bias[cols]) in out's dtype; acc [BN, BM] fp32."""
        y = acc * tl.load(ws_ptr + cols)[:, None] * tl.load(xs_ptr + rows, mask=row_ok, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols).to(tl.float32)[:, None]
        tl.store(out_ptr + rows[None, :] * N + cols[:, None], y.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])

    def gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, x_stride, w_stride,
                    k_per_run, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        """Program (output tile j, K run r): outputs j*BLOCK_N.. over K run r. x, w as uint8 (e4m3 bits)."""
        j = tl.program_id(0)
        r = tl.program_id(1)
        cols = j * BLOCK_N + tl.arange(0, BLOCK_N)                                 # [BN] output columns
        rows = tl.arange(0, BLOCK_M)                                               # [BM] x's rows
        row_ok = rows < M
        ks = tl.arange(0, BLOCK_K)
        w_at = w_ptr + cols.to(tl.int64)[:, None] * w_stride + ks[None, :]        # [BN, BK]
        x_at = x_ptr + rows[:, None] * x_stride + ks[None, :]                      # [BM, BK]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)                             # y^T
        PROMOTE: tl.constexpr = min(128, BLOCK_K)
        start = r * k_per_run
        for k in tl.range(start, tl.minimum(start + k_per_run, K), BLOCK_K, num_stages=STAGES):
            wt = tl.load(w_at + k).to(tl.float8e4nv, bitcast=True)                 # [BN, BK]
            xt = tl.load(x_at + k, mask=row_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True)   # [BM, BK]
            # Hopper's FP8 MMAs accumulate with fewer bits than fp32: the sum is moved into fp32 registers
            # every 128 products (torch._scaled_mm's default, use_fast_accum off, asks cuBLAS for fp32 sums
            # too; Triton's own default on sm_90 never moves them: tests/gpu/test_kernels_gpu.py)
            acc = tl.dot(wt, tl.trans(xt), acc, max_num_imprecise_acc=PROMOTE)
        at = rows[None, :] * N + cols[:, None]                                     # [BN, BM] in [M, N]
        if SPLIT:
            tl.store(part_ptr + r.to(tl.int64) * M * N + at, acc, mask=row_ok[None, :])
        else:
            scaled_store(acc, xs_ptr, ws_ptr, bias_ptr, out_ptr, rows, cols, row_ok, N, HAS_BIAS)

    def reduce_kernel(part_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row m, column block c): out[m, cols] = s_x[m] s_w[cols] sum_r part[r, m, cols] (+ bias)."""
        m = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        acc = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(SPLIT):
            acc += tl.load(part_ptr + (r * M + m).to(tl.int64) * N + cols, mask=ok, other=0.0)
        y = acc * tl.load(ws_ptr + cols, mask=ok, other=0.0) * tl.load(xs_ptr + m)
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m.to(tl.int64) * N + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    global scaled_store
    scaled_store = triton.jit(scaled_store_fn)
    return {"gemm": triton.jit(gemm_kernel, do_not_specialize=["M"]),
            "reduce": triton.jit(reduce_kernel, do_not_specialize=["M"])}


_triton = LazyTriton(_build, "fp8-small-gemm")

"""A mixture of experts' MLP for a few rows (a decode step's M <= 64), in Triton kernels that read only the weights
of the experts the rows chose, with no host read-back (a CUDA graph replays it).

    experts_few_rows(x [M, hidden], gate_up [E, 2 Im, hidden], down [E, hidden, Im], weights [M, k], chosen [M, k],
                     gate_up_scale [E, 2 Im] | None, down_scale [E, hidden] | None)
        -> out [M, hidden] in x's dtype, out[m] = sum_j weights[m, j] down[e] (silu(gate[e] x_m) * up[e] x_m)
           with e = chosen[m, j] (gate[e]: gate_up[e]'s first Im rows, up[e] its last Im),
           or None where these kernels do not apply (the caller runs engine/model/moe.py's grouped or dense path)

Why: at a decode step's few rows the experts' MLP is the chosen experts' weights, read once. The grouped GEMM
(engine/moe.grouped_experts) first sorts the choices by expert in a handful of small kernels, and its tiles are
cut for many rows; a dense sum over every expert reads E / k times the bytes.

How (no sort, the grid fixed by the shapes alone):
- candidates: program c of the first grid axis runs expert c (when E <= M k), else the expert of choice slot c
  (when M k < E: at one row, only the k chosen experts get programs), skipping a slot whose expert an earlier slot
  already runs. A candidate builds its rows from chosen [M, k] (the rows m that chose its expert e, and each one's
  choice index j_m); with none it returns before reading a weight. Each choice (m, j) so has one program an
  output block.
- gate_up: program (c, n) reads gate[e] and up[e]'s rows n BLOCK_N.. over all of hidden (fp32 sums, operands
  swapped so that the weight's rows are the MMA's wide side and the few rows, padded to 16, its narrow side),
  and stores silu(gate) * up, in x's dtype as the model keeps it, to act[m, j_m, n-block] ([M, k, Im]).
- down: program (c, n) reads act[m, j_m, :] and down[e]'s rows n BLOCK_N.., and stores weights[m, j_m] times the
  fp32 product to y[m, j_m, n-block] ([M, k, hidden] fp32); out = y summed over j in j's order and cast in
  one kernel (kernels/moe_grouped.sum_choices).
- no split of K: silu needs a whole sum, so the gate_up kernel finds its programs in narrower output blocks
  (choose_block_n); the down kernel does the same.
- FP8 experts (--quantization fp8: gate_up and down float8_e4m3fn, one fp32 scale per expert per output row): the
  kernels read the FP8 bytes (half of bf16's: the point at decode) and multiply them as FP8 on the tensor cores, as
  a dense FP8 linear does (kernels/fp8_small_gemm.py): x quantized per row (fp8.quantize_rows) before the gate_up
  kernel and each choice's silu*up row (in x's dtype) after it, fp32 sums, the rows' and the weights' scales
  applied to them. Why an FP8 dot rather than FP8 tiles widened to x's dtype against unquantized rows: every other
  FP8 GEMM of the model quantizes its rows too (the grouped GEMM of a prefill's rows, the dense linears, the CPU's
  path), so a decode step computes what a prefill computes, the same operands quantized at the same points (only
  their sums' and bf16 roundings differ); and half the operand bytes through shared memory.
Shapes the kernels take: M <= 64, Im and hidden multiples of 16 (of 32 for FP8: its MMA's K step), x, gate_up and
down of one dtype (fp16, bf16, fp32), or FP8 weights and their fp32 scales with x in one of those; the weights
contiguous. Triton's interpreter (TRITON_INTERPRET=1) runs the same kernels on the CPU
(tests/kernels/test_moe_few_rows.py).
"""
import os

import torch

from burstserve.kernels.arith import next_pow2
from burstserve.kernels.device import num_sms
from burstserve.kernels.fp8 import FP8, quantize_rows
from burstserve.kernels.moe_grouped import sum_choices
from burstserve.kernels.triton_setup import LazyTriton, bf16_by_bits

tl = None                  # triton.language, bound by _build (the kernels resolve it as a global)
expert_rows = mma = cast = operand = None   # the kernels' shared pieces, jitted by _build (resolved as globals too)
_bf16 = None               # the interpreter's bf16 rounding (kernels/triton_setup.py), bound by _build

MAX_ROWS = 64              # above this, the grouped GEMM (its sort amortized, its tiles full)
BLOCK_NS = (64, 32, 16)    # output blocks, widest first (16: the MMA's narrowest side)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def experts_few_rows(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                     chosen: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
                     down_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """See the module docstring; the scales given: FP8 weights."""
    if x.shape[0] > MAX_ROWS or x.shape[0] == 0:
        return None
    kern = _triton.kernels(x.device)
    if kern is None:
        return None
    try:
        return _launch(kern, x, gate_up, down, weights, chosen, gate_up_scale, down_scale)
    except Exception as e:          # compile or launch failure: the torch path from now on
        _triton.failed(e)
        return None


def choose_block_n(candidates: int, n: int, num_sms: int, waves: int) -> int | None:
    """The output block of a kernel with `candidates` experts' programs over n outputs: the widest of BLOCK_NS that
    divides n and still makes `waves` programs an SM (at one row only k experts run, and a few wide programs
    leave most SMs idle while the weights stream), else the narrowest that divides n; None where none does."""
    fits = [b for b in BLOCK_NS if n % b == 0]
    for b in fits:
        if candidates * (n // b) >= waves * num_sms:
            return b
    return fits[-1] if fits else None


def fit_block_k(k: int, widest: int) -> int | None:
    """The widest power of 2 <= widest (and >= 16) dividing k: the K tile; None where 16 does not divide k."""
    b = widest
    while b >= 16 and k % b:
        b //= 2
    return b if b >= 16 else None


def _launch(kern, x, gate_up, down, weights, chosen, gate_up_scale=None, down_scale=None, block_n=None, block_k=128,
            stages=3, warps=4, waves=2):
    """Both kernels and the sum over the choices, or None for shapes they do not take."""
    m, hidden = x.shape
    num_experts, two_im, _ = gate_up.shape
    im = two_im // 2
    top_k = chosen.shape[1]
    if not _takes(x, gate_up, down, weights, chosen, gate_up_scale, down_scale):
        return None
    fp8 = gate_up_scale is not None
    by_slot = m * top_k < num_experts
    candidates = m * top_k if by_slot else num_experts
    sms = num_sms(x.device) if x.device.type == "cuda" else 4          # the interpreter: any count
    bn_up = block_n or choose_block_n(candidates, im, sms, waves)
    bn_down = block_n or choose_block_n(candidates, hidden, sms, waves)
    bk_up, bk_down = fit_block_k(hidden, block_k), fit_block_k(im, block_k)
    if None in (bn_up, bn_down, bk_up, bk_down) or im % bn_up or hidden % bn_down or (fp8 and min(bk_up, bk_down) < 32):
        return None
    chosen, weights = chosen.contiguous(), weights.contiguous()
    act = torch.empty(m, top_k, im, dtype=x.dtype, device=x.device)                   # silu(gate) * up per choice
    y = torch.empty(m, top_k, hidden, dtype=torch.float32, device=x.device)           # weighted down per choice
    shared = dict(TOP_K=top_k, BY_SLOT=by_slot, BLOCK_M=max(16, next_pow2(m)), BLOCK_MK=max(16, next_pow2(m * top_k)),
                  BLOCK_TOPK=max(2, next_pow2(top_k)), PRECISION=_dot_precision(x.dtype), FP8=fp8,
                  INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", STAGES=stages, num_warps=warps)
    # FP8: the rows quantized, as bytes, and their scales; else the rows (the scales' places take unread tensors)
    x_in, x_scale, gu_scale = (*_bytes_and_scales(x), gate_up_scale) if fp8 else (x, x, gate_up)
    kern["gate_up"][(candidates, im // bn_up)](x_in, x_scale, _bytes(gate_up), gu_scale, chosen, act, m, hidden, im,
                                               x_in.stride(0), BLOCK_N=bn_up, BLOCK_K=bk_up, **shared)
    a_in, a_scale, d_scale = (*_bytes_and_scales(act.view(m * top_k, im)), down_scale) if fp8 else (act, act, down)
    kern["down"][(candidates, hidden // bn_down)](a_in, a_scale, _bytes(down), d_scale, chosen, weights, y, m, hidden,
                                                  im, BLOCK_N=bn_down, BLOCK_K=bk_down, **shared)
    return sum_choices(y.view(m * top_k, hidden), None, top_k, x.dtype)        # one kernel: sum, then the cast


def _takes(x, gate_up, down, weights, chosen, gate_up_scale, down_scale) -> bool:
    """Whether the kernels take these operands: see the module docstring."""
    m, hidden = x.shape
    num_experts, two_im, _ = gate_up.shape
    im = two_im // 2
    fp8 = gate_up_scale is not None
    weight_dtype = FP8 if fp8 else x.dtype
    scales = (gate_up_scale, down_scale)
    scales_ok = not fp8 or (down_scale is not None and gate_up_scale.shape == (num_experts, 2 * im)
                            and down_scale.shape == (num_experts, hidden)
                            and all(s.dtype == torch.float32 and s.is_contiguous() for s in scales))
    return (0 < m <= MAX_ROWS and x.dtype in DTYPES and gate_up.dtype == weight_dtype and down.dtype == weight_dtype
            and gate_up.shape == (num_experts, 2 * im, hidden) and down.shape == (num_experts, hidden, im)
            and weights.shape == (m, chosen.shape[1]) and all(t.is_contiguous() for t in (gate_up, down))
            and x.stride(1) == 1 and scales_ok)


def _bytes_and_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [R, K] -> (their per-row FP8 quantization as bytes [R, K] uint8, its scales [R, 1] fp32)."""
    q, scale = quantize_rows(rows)
    return _bytes(q.contiguous()), scale.contiguous()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as its bytes, which the kernels bitcast back to e4m3 (as kernels/fp8_small_gemm.py's do)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands multiplied in full (Triton's default on CUDA rounds them to tf32); 16-bit ones ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _build() -> dict:
    """jit the two kernels. A fresh set each call: tests build interpreted ones (TRITON_INTERPRET=1)."""
    global tl, _bf16
    import triton
    import triton.language as tl
    _bf16 = bf16_by_bits()

    def mma_fn(w, xt, acc, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, FP8: tl.constexpr,
               PROMOTE: tl.constexpr):
        """acc + w @ xt in fp32 (the interpreter's 16-bit tl.dot is wrong: its operands in fp32 there, FP8 ones exact
        in it). FP8 operands: the MMAs' own sums moved into fp32 every PROMOTE products, as
        kernels/fp8_small_gemm.py's."""
        if INTERPRETED:
            return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        if FP8:
            return tl.dot(w, xt, acc, max_num_imprecise_acc=PROMOTE)
        return tl.dot(w, xt, acc, input_precision=PRECISION)

    def operand_fn(v, FP8: tl.constexpr):
        """A loaded tile as the MMA takes it: FP8 bytes (uint8) bitcast to e4m3, anything else as it is. One
        return: Triton's compiler types every return of a function alike, a branch not taken included (two
        returns of e4m3 and uint8 did not compile; the interpreter ran them)."""
        if FP8:
            v = v.to(tl.float8e4nv, bitcast=True)
        return v

    def cast_fn(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
        """fp32 v in dtype, to nearest even (the interpreter's fp32 -> bf16 cast is not: by bits there)."""
        if INTERPRETED and dtype == tl.bfloat16:
            v = _bf16(v)
        return v.to(dtype)

    def expert_rows_fn(chosen_ptr, M, TOP_K: tl.constexpr, BY_SLOT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_MK: tl.constexpr, BLOCK_TOPK: tl.constexpr):
        """Candidate program_id(0) -> (e, rows [BM]: chose e, j [BM]: which of their choices, live: run it)."""
        c = tl.program_id(0)
        if BY_SLOT:
            e = tl.load(chosen_ptr + c)                                            # slot c's expert
            slots = tl.arange(0, BLOCK_MK)
            earlier = tl.load(chosen_ptr + slots, mask=slots < c, other=-1) == e   # [BMK] an earlier slot runs e
            first = tl.max(earlier.to(tl.int32), axis=0) == 0
        else:
            e = c.to(tl.int64)
            first = e >= 0
        rows = tl.arange(0, BLOCK_M)
        js = tl.arange(0, BLOCK_TOPK)
        ok = (rows < M)[:, None] & (js < TOP_K)[None, :]
        hit = tl.load(chosen_ptr + rows[:, None] * TOP_K + js[None, :], mask=ok, other=-1) == e   # [BM, BTOPK]
        row_ok = tl.max(hit.to(tl.int32), axis=1) > 0                                            # [BM]
        j = tl.sum(tl.where(hit, js[None, :], 0), axis=1)                    # [BM] (a row's experts are distinct)
        live = first & (tl.max(row_ok.to(tl.int32), axis=0) > 0)
        return e, row_ok, j, live

    def gate_up_kernel(x_ptr, xs_ptr, gu_ptr, gus_ptr, chosen_ptr, act_ptr, M, HID, IM, x_stride,
                       TOP_K: tl.constexpr, BY_SLOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_MK: tl.constexpr,
                       BLOCK_TOPK: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
                       INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        """Program (candidate, n): act[m, j_m, n BN..] = silu(gate[e] x_m) * up[e] x_m for the rows m that chose e.
        FP8: x and gate_up as e4m3 bytes, xs [M] and gus [E, 2 Im] their scales (unread otherwise)."""
        e, row_ok, j, live = expert_rows(chosen_ptr, M, TOP_K, BY_SLOT, BLOCK_M, BLOCK_MK, BLOCK_TOPK)
        if live == 0:
            return
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN] of Im
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        g_at = gu_ptr + e * 2 * IM * HID + cols.to(tl.int64)[:, None] * HID + ks[None, :]   # [BN, BK] gate rows
        u_at = g_at + IM * HID                                                    # the up rows
        x_at = x_ptr + rows[:, None] * x_stride + ks[None, :]                     # [BM, BK]
        gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)                           # (gate x)^T
        up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        PROMOTE: tl.constexpr = min(128, BLOCK_K)
        for k in tl.range(0, HID, BLOCK_K, num_stages=STAGES):
            xt = tl.trans(operand(tl.load(x_at + k, mask=row_ok[:, None], other=0), FP8))    # [BK, BM]
            gate = mma(operand(tl.load(g_at + k), FP8), xt, gate, PRECISION, INTERPRETED, FP8, PROMOTE)
            up = mma(operand(tl.load(u_at + k), FP8), xt, up, PRECISION, INTERPRETED, FP8, PROMOTE)
        if FP8:                                                                   # the rows' and weights' scales
            xs = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)[None, :]          # [1, BM]
            s_at = gus_ptr + e * 2 * IM + cols                                    # [BN] gate's, then up's at + IM
            gate = gate * tl.load(s_at)[:, None] * xs
            up = up * tl.load(s_at + IM)[:, None] * xs
        act = gate / (1.0 + tl.exp(-gate)) * up                                   # [BN, BM]
        at = act_ptr + (rows * TOP_K + j)[None, :] * IM + cols[:, None]
        tl.store(at, cast(act, act_ptr.dtype.element_ty, INTERPRETED), mask=row_ok[None, :])

    def down_kernel(act_ptr, as_ptr, down_ptr, ds_ptr, chosen_ptr, w_ptr, y_ptr, M, HID, IM, TOP_K: tl.constexpr,
                    BY_SLOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_MK: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                    PRECISION: tl.constexpr, FP8: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        """Program (candidate, n): y[m, j_m, n BN..] = weights[m, j_m] down[e] act[m, j_m], the rows that chose e.
        FP8: act and down as e4m3 bytes, as [M k] and ds [E, hidden] their scales (unread otherwise)."""
        e, row_ok, j, live = expert_rows(chosen_ptr, M, TOP_K, BY_SLOT, BLOCK_M, BLOCK_MK, BLOCK_TOPK)
        if live == 0:
            return
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN] of hidden
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        choice = rows * TOP_K + j                                                 # [BM] row of [M k]
        d_at = down_ptr + e * HID * IM + cols.to(tl.int64)[:, None] * IM + ks[None, :]      # [BN, BK]
        a_at = act_ptr + choice[:, None] * IM + ks[None, :]                       # [BM, BK]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        PROMOTE: tl.constexpr = min(128, BLOCK_K)
        for k in tl.range(0, IM, BLOCK_K, num_stages=STAGES):
            at = tl.trans(operand(tl.load(a_at + k, mask=row_ok[:, None], other=0), FP8))    # [BK, BM]
            acc = mma(operand(tl.load(d_at + k), FP8), at, acc, PRECISION, INTERPRETED, FP8, PROMOTE)
        w = tl.load(w_ptr + choice, mask=row_ok, other=0.0).to(tl.float32)        # [BM]
        if FP8:                                                                   # the rows' and weights' scales
            w = w * tl.load(as_ptr + choice, mask=row_ok, other=0.0)
            acc = acc * tl.load(ds_ptr + e * HID + cols)[:, None]
        tl.store(y_ptr + choice[None, :] * HID + cols[:, None], acc * w[None, :], mask=row_ok[None, :])

    global expert_rows, mma, cast, operand
    expert_rows, mma, cast = triton.jit(expert_rows_fn), triton.jit(mma_fn), triton.jit(cast_fn)
    operand = triton.jit(operand_fn)
    return {"gate_up": triton.jit(gate_up_kernel, do_not_specialize=["M"]),
            "down": triton.jit(down_kernel, do_not_specialize=["M"])}


_triton = LazyTriton(_build, "moe-few-rows")

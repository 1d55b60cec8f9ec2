"""The decoder's small per-token operations, each one kernel on CUDA (Triton), plain torch ops elsewhere.

    rms_norm(x, weight, eps, residual=None) -> normed                (residual None)
                                            -> (normed, x + residual) (the residual stream, updated)
    rope_(qkv, cos, sin, num_heads, num_kv_heads, norms=None)        rotates q and k inside qkv, in place;
                                                                     norms (q_norm, k_norm, eps): Qwen3's q/k
                                                                     head norms first, in the same kernel
    store_kv(k_cache, v_cache, slots, k, v)                          k, v rows into a paged layer cache
    silu_and_mul(gate_up) -> silu(gate) * up
    quantize_fp8_rows(x) -> (x_fp8, scales) or None                 kernels/fp8.py's per-token quantization

(The attention merge's kernels are in kernels/merge.py.)

A decode step of an 8B model spends a large share of its GPU time on these when each is a chain of
torch ops (41 kernels a layer at llama3-8b's shapes, against 13-15 fused).
The Triton kernels round where the torch ops round (bf16 after each product and sum, as transformers'
LLaMA does), so they agree with the torch path to fp32 summation order. The torch ops are the path off
CUDA; on CUDA a kernel that fails to build or launch logs once and the torch ops serve from then on
(kernels/triton_setup.py; the GPU tests clear `_triton.enabled` to run the torch ops).
"""
import torch
import torch.nn.functional as F

from burstserve.kernels.arith import ceil_div, next_pow2
from burstserve.kernels.triton_setup import LazyTriton

tl = None   # triton.language, bound by _build (the kernels resolve it as a global)


# ---------------------------------------------------------------- the operations

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [S, hidden] -> weight * normalize(x) (fp32 statistics, bf16 product, as transformers). With
    residual [S, hidden]: x + residual is normalized, and (normed, x + residual) returned."""
    kern = _triton.kernels(x.device)
    if kern is not None and x.shape[0] > 0:
        try:
            return _rms_norm_triton(kern["rms_norm"], x, weight, eps, residual)
        except Exception as e:
            _triton.failed(e)
    if residual is not None:
        x = x + residual
        return _rms_norm_torch(x, weight, eps), x
    return _rms_norm_torch(x, weight, eps)


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
          norms: tuple | None = None) -> None:
    """qkv [S, (H + 2 Hkv) D] (rows contiguous): q's H heads and k's Hkv heads rotated in place
    (rotate-half, as transformers' LLaMA); cos, sin [S, D] in qkv's dtype. norms (q_norm [D], k_norm [D], eps):
    each of those heads first RMS-normed over its D values, times q_norm or k_norm (Qwen3's norms before RoPE, in
    transformers' Qwen3RMSNorm order: normed in fp32, rounded to qkv's dtype, then times the weight, rounded)."""
    kern = _triton.kernels(qkv.device)
    if kern is not None and qkv.shape[0] > 0:
        try:
            return _rope_triton(kern["rope"], qkv, cos, sin, num_heads, num_kv_heads, norms)
        except Exception as e:
            _triton.failed(e)
    d = cos.shape[-1]
    rot = qkv[:, :(num_heads + num_kv_heads) * d].view(qkv.shape[0], num_heads + num_kv_heads, d)   # [S, H + Hkv, D]
    if norms is not None:
        _head_norms_torch(rot, *norms, num_heads)
    rot.copy_(_rope_torch(rot, cos[:, None], sin[:, None]))


def _head_norms_torch(heads: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                      num_heads: int) -> None:
    """heads [S, H + Hkv, D] normed in place: the first num_heads with q_norm, the rest with k_norm."""
    for part, weight in ((heads[:, :num_heads], q_norm), (heads[:, num_heads:], k_norm)):
        xf = part.float()
        part.copy_(weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(part.dtype))


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k, v [n, Hkv, D] (any row stride) into slots [n] int64 of k_cache, v_cache [pages, block, Hkv, D]."""
    kern = _triton.kernels(k.device)
    if kern is not None and k.shape[0] > 0:
        try:
            return _store_kv_triton(kern["store_kv"], k_cache, v_cache, slots, k, v)
        except Exception as e:
            _triton.failed(e)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [S, 2 I] -> silu(gate) * up [S, I] (each rounded to the input dtype, as torch)."""
    kern = _triton.kernels(gate_up.device)
    if kern is not None and gate_up.shape[0] > 0:
        try:
            return _silu_and_mul_triton(kern["silu_and_mul"], gate_up)
        except Exception as e:
            _triton.failed(e)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------- torch (CPU, and the reference)

def _rms_norm_torch(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope_torch(x, cos, sin):
    """x [S, H, D], cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def quantize_fp8_rows(x: torch.Tensor):
    """x [M, K] -> (x / s as float8_e4m3fn [M, K], s [M, 1] fp32), s = max |x[m]| / 448, in one kernel
    (one read of x, one write: the torch ops read it three times and write two temporaries); None where
    there is no Triton kernel (the caller uses its torch ops)."""
    kern = _triton.kernels(x.device)
    if kern is None or x.shape[0] == 0:
        return None
    try:
        x = _rows(x)
        m, k = x.shape
        q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
        block = next_pow2(k)
        kern["quantize_fp8"][(m,)](x, q, scale, k, x.stride(0), BLOCK=block, num_warps=_row_warps(block))
        return q, scale
    except Exception as e:
        _triton.failed(e)
        return None


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """rms_norm's output quantized per row to float8_e4m3fn in the same kernel -> (q [S, n], scales [S, 1]
    fp32), or with a residual (q, scales, x + residual); the same bits as rms_norm then quantize_fp8_rows.
    None where there is no Triton kernel (the caller runs the two steps)."""
    kern = _triton.kernels(x.device)
    if kern is None or x.shape[0] == 0:
        return None
    try:
        return _rms_norm_fp8_triton(kern["rms_norm_fp8"], x, weight, eps, residual)
    except Exception as e:
        _triton.failed(e)
        return None


def silu_and_mul_fp8(gate_up: torch.Tensor):
    """silu_and_mul's output quantized per row to float8_e4m3fn in the same kernel -> (q [S, I], scales
    [S, 1] fp32); the same bits as the two steps. None where there is no Triton kernel."""
    kern = _triton.kernels(gate_up.device)
    if kern is None or gate_up.shape[0] == 0:
        return None
    try:
        return _silu_and_mul_fp8_triton(kern["silu_and_mul_fp8"], gate_up)
    except Exception as e:
        _triton.failed(e)
        return None


# ---------------------------------------------------------------- Triton

def _build() -> dict:
    """jit the kernels (a fresh set each call: the CPU tests build interpreted ones)."""
    global tl
    import triton
    import triton.language as tl

    def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, x_stride, res_stride, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        """Program = one row of n values: [res_out = x + res;] out = w * (x * rsqrt(mean(x^2) + eps))."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.max_contiguous(tl.arange(0, BLOCK), 8)   # runs of 8: the note above the jit calls
        mask = cols < n
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * n + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    def rope_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, row_stride, cs_stride, num_q, num_rot, eps,
                    D: tl.constexpr, HALF: tl.constexpr, HEADS_PAD: tl.constexpr, NORM: tl.constexpr):
        """Program = one token: its first num_rot heads of D rotated in place,
        out[:half] = x1 cos1 - x2 sin1, out[half:] = x2 cos2 + x1 sin2 (each product rounded, then the sum).
        NORM: each head first RMS-normed, (x * rsqrt(mean(x^2) + eps)) rounded to qkv's dtype, times its weight
        (q's num_q heads qw [D], the others kw), rounded."""
        s = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HEADS_PAD)[:, None]
        i = tl.arange(0, HALF)[None, :]
        mask = heads < num_rot
        base = qkv_ptr + s * row_stride + heads * D + i                        # [HEADS_PAD, HALF]
        dt = qkv_ptr.dtype.element_ty
        x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
        if NORM:
            rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
            is_q = heads < num_q
            w1 = tl.where(is_q, tl.load(qw_ptr + i).to(tl.float32), tl.load(kw_ptr + i).to(tl.float32))
            w2 = tl.where(is_q, tl.load(qw_ptr + HALF + i).to(tl.float32), tl.load(kw_ptr + HALF + i).to(tl.float32))
            x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c1 = tl.load(cos_ptr + s * cs_stride + i).to(tl.float32)
        c2 = tl.load(cos_ptr + s * cs_stride + HALF + i).to(tl.float32)
        s1 = tl.load(sin_ptr + s * cs_stride + i).to(tl.float32)
        s2 = tl.load(sin_ptr + s * cs_stride + HALF + i).to(tl.float32)
        o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        tl.store(base, o1.to(dt), mask=mask)
        tl.store(base + HALF, o2.to(dt), mask=mask)

    def store_kv_kernel(k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, k_stride, v_stride, n,
                        BLOCK: tl.constexpr):
        """Program = one token: its n = Hkv * D values of k and of v into row slots[token] of the caches."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        slot = tl.load(slots_ptr + t).to(tl.int64)
        tl.store(k_cache_ptr + slot * n + cols, tl.load(k_ptr + t * k_stride + cols, mask=mask), mask=mask)
        tl.store(v_cache_ptr + slot * n + cols, tl.load(v_ptr + t * v_stride + cols, mask=mask), mask=mask)

    def silu_and_mul_kernel(x_ptr, out_ptr, inter, x_stride, BLOCK: tl.constexpr):
        """Program (token, block of I): out = rounded(silu(gate)) * up."""
        s = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        dt = out_ptr.dtype.element_ty
        g = tl.load(x_ptr + s * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + s * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + s * inter + cols, (a * u).to(dt), mask=mask)

    def quantize_fp8_kernel(x_ptr, q_ptr, scale_ptr, k, x_stride, BLOCK: tl.constexpr):
        """Program = one row of k values: s = max |x| / 448 (at least 1e-12), q = x / s in float8_e4m3fn."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < k
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 448.0 * 1e-12)
        q = tl.clamp(x * (448.0 / amax), -448.0, 448.0)
        tl.store(q_ptr + row * k + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, amax / 448.0)

    def rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, res_out_ptr, n, x_stride, res_stride, eps,
                            HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        """rms_norm_kernel's row, rounded to x's dtype as it would store it, then quantized as
        quantize_fp8_kernel does (the same bits as the two kernels, without the normed row's round trip)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.max_contiguous(tl.arange(0, BLOCK), 8)   # runs of 8: the note above the jit calls
        mask = cols < n
        dt = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
            tl.store(res_out_ptr + row * n + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        y = (xf * rstd).to(dt).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (w * y).to(dt).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(y), axis=0), 448.0 * 1e-12)
        q = tl.clamp(y * (448.0 / amax), -448.0, 448.0)
        tl.store(q_ptr + row * n + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, amax / 448.0)

    def silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, inter, x_stride, BLOCK: tl.constexpr):
        """Program = one token: silu_and_mul_kernel's row, rounded to x's dtype, quantized as
        quantize_fp8_kernel does."""
        s = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < inter
        dt = x_ptr.dtype.element_ty
        g = tl.load(x_ptr + s * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + s * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = (a * u).to(dt).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(y), axis=0), 448.0 * 1e-12)
        q = tl.clamp(y * (448.0 / amax), -448.0, 448.0)
        tl.store(q_ptr + s * inter + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + s, amax / 448.0)

    # sizes and strides specialized (Triton compiles one variant per pattern of "divisible by 16" and "== 1"
    # among them, a handful for a model): unspecialized, it cannot prove a row 16-byte aligned and moves
    # every element alone (2-byte loads, byte stores), at under half the memory's rate. The two norms declare their columns contiguous
    # in runs of 8 only, so both move their rows as 8-value vectors and sum them in one order. Left to
    # itself, Triton takes 16 values a thread in rms_norm_fp8 (its FP8 store) and 8 in rms_norm, and the
    # fused norm would no longer give rms_norm-then-quantize_fp8's bits.
    return {
        "rms_norm": triton.jit(rms_norm_kernel),
        "rope": triton.jit(rope_kernel),
        "store_kv": triton.jit(store_kv_kernel),
        "silu_and_mul": triton.jit(silu_and_mul_kernel),
        "quantize_fp8": triton.jit(quantize_fp8_kernel),
        "rms_norm_fp8": triton.jit(rms_norm_fp8_kernel),
        "silu_and_mul_fp8": triton.jit(silu_and_mul_fp8_kernel),
    }


_triton = LazyTriton(_build, "fused")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D view whose rows are contiguous (a copy only when they are not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _row_warps(block: int) -> int:
    """Warps for a program of one row of `block` values: 4 up to 4096, then one per 1024, at most 16. A row's
    sum is taken in an order that depends on the warps, so kernels whose bits must agree use this alike."""
    return min(16, max(4, block // 1024))


def _rms_norm_triton(kernel, x, weight, eps, residual):
    x = _rows(x)
    s, n = x.shape
    out = torch.empty(s, n, dtype=x.dtype, device=x.device)
    block = next_pow2(n)
    warps = _row_warps(block)     # as rms_norm_fp8's: the same order of the row's sum, so the same bits
    if residual is None:
        kernel[(s,)](x, x, weight, out, out, n, x.stride(0), 0, eps, HAS_RES=False, BLOCK=block, num_warps=warps)
        return out
    residual = _rows(residual)
    res_out = torch.empty_like(out)
    kernel[(s,)](x, residual, weight, out, res_out, n, x.stride(0), residual.stride(0), eps,
                 HAS_RES=True, BLOCK=block, num_warps=warps)
    return out, res_out


def _rope_triton(kernel, qkv, cos, sin, num_heads, num_kv_heads, norms=None):
    d = cos.shape[-1]
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        raise ValueError("rope_: rows must be contiguous and cos, sin alike")
    q_norm, k_norm, eps = norms if norms is not None else (cos, cos, 0.0)      # (unread without NORM)
    kernel[(qkv.shape[0],)](qkv, cos, sin, q_norm, k_norm, qkv.stride(0), cos.stride(0), num_heads,
                            num_heads + num_kv_heads, eps, D=d, HALF=d // 2, HEADS_PAD=next_pow2(num_heads + num_kv_heads),
                            NORM=norms is not None)


def _store_kv_triton(kernel, k_cache, v_cache, slots, k, v):
    n = k.shape[1] * k.shape[2]
    if k.stride(2) != 1 or k.stride(1) != k.shape[2] or v.stride(2) != 1 or v.stride(1) != v.shape[2]:
        k, v = k.contiguous(), v.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv: the caches must be contiguous")
    kernel[(k.shape[0],)](k, v, slots, k_cache, v_cache, k.stride(0), v.stride(0), n, BLOCK=next_pow2(n))


def _silu_and_mul_triton(kernel, gate_up):
    gate_up = _rows(gate_up)
    s, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(s, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(inter))
    kernel[(s, ceil_div(inter, block))](gate_up, out, inter, gate_up.stride(0), BLOCK=block)
    return out


def _rms_norm_fp8_triton(kernel, x, weight, eps, residual):
    x = _rows(x)
    s, n = x.shape
    q = torch.empty(s, n, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(s, 1, dtype=torch.float32, device=x.device)
    block = next_pow2(n)
    warps = _row_warps(block)
    if residual is None:
        kernel[(s,)](x, x, weight, q, scale, x, n, x.stride(0), 0, eps, HAS_RES=False, BLOCK=block, num_warps=warps)
        return q, scale
    residual = _rows(residual)
    res_out = torch.empty_like(x)
    kernel[(s,)](x, residual, weight, q, scale, res_out, n, x.stride(0), residual.stride(0), eps,
                 HAS_RES=True, BLOCK=block, num_warps=warps)
    return q, scale, res_out


def _silu_and_mul_fp8_triton(kernel, gate_up):
    gate_up = _rows(gate_up)
    s, inter = gate_up.shape[0], gate_up.shape[1] // 2
    q = torch.empty(s, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty(s, 1, dtype=torch.float32, device=gate_up.device)
    block = next_pow2(inter)
    kernel[(s,)](gate_up, q, scale, inter, gate_up.stride(0), BLOCK=block, num_warps=_row_warps(block))
    return q, scale

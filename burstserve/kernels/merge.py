"""Online-softmax (LSE) merge of partial attention results, in fp32: the one place it is written.

A partial result over a block of keys is (out, lse): out is softmax-weighted V over that block, lse the
log-sum-exp of the block's scores. P partials of the same queries combine as
    m = max_p lse_p,  w_p = exp(lse_p - m),  s = sum_p w_p
    lse = m + log s,  out = sum_p out_p * w_p / s
An empty or fully masked block has lse = -inf and weighs 0; queries whose partials are all empty get
out = 0, lse = -inf (never NaN).

    merge_into(out, lse, block_out, block_lse)     in place: an accumulator absorbs one partial (the ring's step)
    merge_partials(outs, lses, dtype, used=None)   P stacked partials -> (out in dtype, lse fp32)
    merge_stacked(outs, lses, valid=None)          merge_partials' torch ops, out in fp32 (the reference)

On CUDA each of the first two is one Triton kernel (one read of each input, one write) where the torch
ops take 10-15 small kernels; elsewhere, and on CUDA after a kernel fails (logged once), the torch ops
serve. Both compute the weights as above (`_weights`), as the kernels do, so they agree to fp32
rounding. Nothing here reads a value on the host: the merges can be captured in a CUDA graph.
"""
import torch

from burstserve.kernels.arith import next_pow2
from burstserve.kernels.triton_setup import LazyTriton

tl = None   # triton.language, bound by _build (the kernels resolve it as a global)


# ---------------------------------------------------------------- the operations

def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place: out [R, H, D] (any float dtype, rows may be a slice), lse [R, H] fp32 absorb a partial
    over other keys, block_out [R, H, D] (any dtype), block_lse [R, H] (any strides). fp32 math; an out
    of a narrower dtype (bf16) is rounded once, when written back. Layouts the kernel does not take (D
    not contiguous or not a power of 2, an lse not fp32) go through the torch ops."""
    kern = _triton.kernels(out.device)
    if kern is not None and out.shape[0] > 0 and _pair_kernel_takes(out, lse, block_out, block_lse):
        try:
            return _merge_into_triton(kern["merge_into"], out, lse, block_out, block_lse)
        except Exception as e:
            _triton.failed(e)
    _merge_into_torch(out, lse, block_out, block_lse)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, dtype: torch.dtype,
                   used: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """P partials of the same rows, outs [P, R, H, D] and lses [P, R, H] (any strides, e.g. views into
    one gathered buffer) -> (out [R, H, D] in dtype, lse [R, H] fp32). used (optional, int, on the
    device): [P], or [P, R] for a per-row count; partial p (of row r) weighs 0 where used is 0, whatever
    it holds (a kernel's output for a run without keys is never read)."""
    kern = _triton.kernels(outs.device)
    if kern is not None:
        try:
            return _merge_partials_triton(kern["merge_partials"], outs, lses, dtype, used)
        except Exception as e:
            _triton.failed(e)
    out, lse = merge_stacked(outs, lses, None if used is None else _used_mask(used, lses.ndim))
    return out.to(dtype), lse


# ---------------------------------------------------------------- torch (off CUDA, and the reference)

def merge_stacked(outs: torch.Tensor, lses: torch.Tensor,
                  valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [P, ..., D], lses [P, ...] (P partials of the same queries) -> (out [..., D] fp32, lse [...]
    fp32). valid (optional): bool, lses.ndim dimensions, broadcastable to lses; partials where it is
    False weigh 0 whatever outs and lses hold there (NaN, inf, garbage: never read into the result).
    13 elementwise/reduction ops with valid, 11 without."""
    lse, w = _weights(lses, valid)                                   # [...], [P, ...]
    if valid is not None:
        outs = torch.where(valid.unsqueeze(-1), outs, 0.0)
    out = (outs * w.unsqueeze(-1)).sum(0)                            # [..., D], fp32 as w
    return out.float(), lse


def _merge_into_torch(out, lse, block_out, block_lse) -> None:
    """merge_into's torch ops: the weights of the two partials as merge_stacked's, applied in place."""
    new_lse, w = _weights(torch.stack([lse.float(), block_lse.float()]))   # [R, H], [2, R, H]
    w = w.unsqueeze(-1)                                                     # [2, R, H, 1]
    if out.dtype == torch.float32:
        out.mul_(w[0]).add_(block_out.float() * w[1])
    else:
        out.copy_(out.float() * w[0] + block_out.float() * w[1])
    lse.copy_(new_lse)


def _weights(lses: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """lses [P, ...] -> (lse [...] fp32, weights [P, ...] fp32: w_p / s of the module docstring, all 0 for
    queries without a partial with keys). valid as merge_stacked's: False weighs 0 whatever lses holds."""
    l = lses.float() if valid is None else torch.where(valid, lses.float(), float("-inf"))
    m = l.amax(0, keepdim=True).clamp_(min=torch.finfo(torch.float32).min)   # finite: -inf - m = -inf
    w = (l - m).exp_()                                                       # 0 for empty partials
    s = w.sum(0, keepdim=True)          # 0 (no partial with keys) or >= 1 (the largest contributes exp(0) = 1)
    lse = s.log().add_(m).squeeze(0)    # log 0 + finite = -inf
    return lse, w / s.clamp_(min=1.0)


def _used_mask(used: torch.Tensor, ndim: int) -> torch.Tensor:
    """used [P] or [P, R] int -> bool with ndim dimensions (trailing ones of size 1): partials with keys."""
    return (used > 0)[(...,) + (None,) * (ndim - used.ndim)]


# ---------------------------------------------------------------- Triton

def _build() -> dict:
    """jit the two kernels (a fresh pair each call: the CPU tests build interpreted ones)."""
    global tl
    import triton
    import triton.language as tl

    def merge_into_kernel(o_ptr, l_ptr, bo_ptr, bl_ptr, H, s_or, s_oh, s_lr, s_lh, s_bor, s_boh, s_blr, s_blh,
                          D: tl.constexpr, H_PAD: tl.constexpr):
        """Program = one row, all its heads: (o, l) absorbs (bo, bl) by LSE in fp32; a partial with
        lse -inf weighs 0, two give o = 0, l = -inf."""
        r = tl.program_id(0).to(tl.int64)
        hs = tl.arange(0, H_PAD)
        hm = hs < H
        la = tl.load(l_ptr + r * s_lr + hs * s_lh, mask=hm, other=float("-inf")).to(tl.float32)
        lb = tl.load(bl_ptr + r * s_blr + hs * s_blh, mask=hm, other=float("-inf")).to(tl.float32)
        m = tl.maximum(la, lb)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(la - m_safe)
        wb = tl.exp(lb - m_safe)
        s = wa + wb                                   # 0 (neither has keys) or >= 1
        s1 = tl.where(s > 0, s, 1.0)
        ds = tl.arange(0, D)[None, :]
        mask = hm[:, None]
        oa = tl.load(o_ptr + r * s_or + hs[:, None] * s_oh + ds, mask=mask, other=0.0).to(tl.float32)
        ob = tl.load(bo_ptr + r * s_bor + hs[:, None] * s_boh + ds, mask=mask, other=0.0).to(tl.float32)
        o = oa * (wa / s1)[:, None] + ob * (wb / s1)[:, None]
        tl.store(o_ptr + r * s_or + hs[:, None] * s_oh + ds, o.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(l_ptr + r * s_lr + hs * s_lh, tl.where(s > 0, tl.log(s1) + m_safe, float("-inf")), mask=hm)

    def merge_partials_kernel(o_ptr, lse_ptr, used_ptr, out_ptr, lse_out_ptr, c, H,
                              s_or, s_oc, s_oh, s_lr, s_lc, s_lh, s_ur, s_uc,
                              D: tl.constexpr, C_PAD: tl.constexpr, D_PAD: tl.constexpr, HAS_USED: tl.constexpr):
        """Program (r, h): merge the c partials of row r, head h by LSE (partial j of row r at
        r*s_or + j*s_oc + h*s_oh in o, likewise in lse); with HAS_USED, partials with
        used[r*s_ur + j*s_uc] == 0 are never read (they weigh 0)."""
        r = tl.program_id(0)
        h = tl.program_id(1)
        cs = tl.arange(0, C_PAD)
        if HAS_USED:
            valid = tl.load(used_ptr + r * s_ur + cs * s_uc, mask=cs < c, other=0) > 0
        else:
            valid = cs < c
        row = r.to(tl.int64)
        part = cs.to(tl.int64)
        lse = tl.load(lse_ptr + row * s_lr + part * s_lc + h * s_lh, mask=valid, other=float("-inf")).to(tl.float32)
        m = tl.max(lse, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.where(valid, tl.exp(lse - m_safe), 0.0)
        s = tl.sum(w, axis=0)                   # 0 (no partial with keys) or >= 1 (the largest gives exp(0))
        s1 = tl.maximum(s, 1.0)
        lse_out = tl.where(s > 0, tl.log(s1) + m_safe, float("-inf"))
        ds = tl.arange(0, D_PAD)
        dm = ds < D
        o = tl.load(o_ptr + row * s_or + part[:, None] * s_oc + h * s_oh + ds[None, :],
                    mask=valid[:, None] & dm[None, :], other=0.0).to(tl.float32)
        acc = tl.sum(o * w[:, None], axis=0) / s1
        base = (r * H + h).to(tl.int64)
        tl.store(out_ptr + base * D + ds, acc.to(out_ptr.dtype.element_ty), mask=dm)
        tl.store(lse_out_ptr + base, lse_out)

    # sizes and strides unspecialized: one compile per dtype, constexpr combination and pointer alignment
    return {
        "merge_into": triton.jit(merge_into_kernel, do_not_specialize=[
            "H", "s_or", "s_oh", "s_lr", "s_lh", "s_bor", "s_boh", "s_blr", "s_blh"]),
        "merge_partials": triton.jit(merge_partials_kernel, do_not_specialize=[
            "c", "H", "s_or", "s_oc", "s_oh", "s_lr", "s_lc", "s_lh", "s_ur", "s_uc"]),
    }


_triton = LazyTriton(_build, "LSE merge")


def _pair_kernel_takes(out, lse, block_out, block_lse) -> bool:
    """merge_into_kernel reads D contiguous lanes, a power of 2, and fp32 lses."""
    d = out.shape[-1]
    return (out.stride(2) == 1 and block_out.stride(2) == 1 and d == next_pow2(d)
            and lse.dtype == torch.float32 and block_lse.dtype == torch.float32)


def _merge_into_triton(kernel, out, lse, block_out, block_lse) -> None:
    r, h, d = out.shape
    kernel[(r,)](out, lse, block_out, block_lse, h, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
                 block_out.stride(0), block_out.stride(1), block_lse.stride(0), block_lse.stride(1),
                 D=d, H_PAD=next_pow2(h))


def _merge_partials_triton(kernel, outs, lses, dtype, used=None):
    """outs [P, R, H, D], lses [P, R, H] -> (out [R, H, D] in dtype, lse [R, H] fp32); used [P] or [P, R]."""
    p, r, h, d = outs.shape
    if outs.stride(3) != 1:
        outs = outs.contiguous()
    o = torch.empty(r, h, d, dtype=dtype, device=outs.device)
    l = torch.empty(r, h, dtype=torch.float32, device=outs.device)
    s_up, s_ur = (0, 0) if used is None else (used.stride(0), used.stride(1) if used.ndim == 2 else 0)
    kernel[(r, h)](outs, lses, l if used is None else used, o, l, p, h, outs.stride(1), outs.stride(0),
                   outs.stride(2), lses.stride(1), lses.stride(0), lses.stride(2), s_ur, s_up,
                   D=d, C_PAD=next_pow2(p), D_PAD=next_pow2(d), HAS_USED=used is not None)
    return o, l

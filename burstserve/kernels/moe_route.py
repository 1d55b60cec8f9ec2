"""A mixture of experts' router after its linear: the softmax over the experts, the top k, their renormalization and
cast, one kernel on CUDA (Triton), torch ops elsewhere.

    route_top_k(logits [S, E], k, renormalize, out_dtype) -> (weights [S, k] out_dtype, chosen [S, k] int64):
        probs = softmax(logits in fp32); the k largest probs, largest first; divided by their sum where
        renormalize; cast to out_dtype (transformers' TopKRouter: engine/model/moe.route)

Why: as torch ops this is six or seven kernels (cast, softmax, topk, sum, divide, cast), each a launch in every
layer of a decode step's CUDA graph, and at a prefill's 16,384-row pieces torch.topk alone costs more than the
router's GEMM. Here one program reads a row's logits once.

Ties: the kernel takes the k largest one at a time, the lowest expert index first among equal probabilities (tie
of the k-th and a later one: the lower index chosen). torch.topk on CUDA keeps the lower index at that boundary
too; on the CPU (where these torch ops run, as transformers runs them) it does not promise an order.
"""
import os

import torch

from burstserve.kernels.arith import ceil_div, next_pow2
from burstserve.kernels.triton_setup import LazyTriton, bf16_by_bits

tl = None      # triton.language, bound by _build (the kernel resolves it as a global)
_bf16 = None   # the interpreter's bf16 rounding (kernels/triton_setup.py), bound by _build
ROWS = 4    # rows a program


def route_top_k(logits: torch.Tensor, k: int, renormalize: bool,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    kern = _triton.kernels(logits.device)
    if kern is not None and logits.shape[0] > 0 and k <= logits.shape[1]:
        try:
            return _route_triton(kern["route"], logits, k, renormalize, out_dtype)
        except Exception as e:
            _triton.failed(e)
    return route_torch(logits, k, renormalize, out_dtype)


def route_torch(logits: torch.Tensor, k: int, renormalize: bool,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops, as transformers computes them."""
    probs = torch.softmax(logits.float(), dim=-1)                            # [S, E] fp32
    weights, chosen = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), chosen


def _build() -> dict:
    """jit the kernel (a fresh one each call: the CPU tests build an interpreted one)."""
    global tl, _bf16
    import triton
    import triton.language as tl
    _bf16 = bf16_by_bits()

    def route_kernel(logits_ptr, w_ptr, chosen_ptr, S, E, stride, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                     K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, INTERPRETED: tl.constexpr):
        """Program = ROWS rows: softmax in fp32, then K rounds of (largest, lowest index among equals; masked out)."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)                  # [R]
        cols = tl.arange(0, BLOCK_E)                                                       # [BE]
        ok = (rows < S)[:, None] & (cols < E)[None, :]
        x = tl.load(logits_ptr + rows[:, None] * stride + cols[None, :], mask=ok, other=float("-inf"))
        x = x.to(tl.float32)
        x = x - tl.max(x, axis=1)[:, None]
        p = tl.exp(x)
        p = tl.where(ok, p, 0.0)
        p = p / tl.sum(p, axis=1)[:, None]                                                # [R, BE] fp32
        p = tl.where(ok, p, -1.0)                                                          # padding never chosen
        ks = tl.arange(0, BLOCK_K)                                                         # [BK]
        top_w = tl.zeros([ROWS, BLOCK_K], tl.float32)
        top_i = tl.zeros([ROWS, BLOCK_K], tl.int32)
        for j in tl.static_range(K):
            best = tl.max(p, axis=1)                                                       # [R]
            at = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)      # [R] lowest index
            top_w = tl.where(ks[None, :] == j, best[:, None], top_w)
            top_i = tl.where(ks[None, :] == j, at[:, None], top_i)
            p = tl.where(cols[None, :] == at[:, None], -2.0, p)
        if RENORMALIZE:
            top_w = top_w / tl.sum(tl.where(ks[None, :] < K, top_w, 0.0), axis=1)[:, None]
        if INTERPRETED and w_ptr.dtype.element_ty == tl.bfloat16:
            top_w = _bf16(top_w)                  # the interpreter's cast does not round to nearest even
        out_ok = (rows < S)[:, None] & (ks < K)[None, :]
        at = rows[:, None] * K + ks[None, :]
        tl.store(w_ptr + at, top_w.to(w_ptr.dtype.element_ty), mask=out_ok)
        tl.store(chosen_ptr + at, top_i.to(tl.int64), mask=out_ok)

    return {"route": triton.jit(route_kernel, do_not_specialize=["S"])}


_triton = LazyTriton(_build, "moe_route")


def _route_triton(kernel, logits, k, renormalize, out_dtype):
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, experts = logits.shape
    weights = torch.empty(rows, k, dtype=out_dtype, device=logits.device)
    chosen = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    kernel[(ceil_div(rows, ROWS),)](logits, weights, chosen, rows, experts, logits.stride(0), ROWS=ROWS,
                                       BLOCK_E=next_pow2(experts), K=k, BLOCK_K=max(2, next_pow2(k)),
                                       RENORMALIZE=renormalize, INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1")
    return weights, chosen


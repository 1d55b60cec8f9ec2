"""How fast can Triton run FP8 attention on this GPU at all? A dense causal FP8 attention with none of our
kernel's duties (no pages, no per-key scales, no LSE out, P cast to e4m3 as FlashAttention-3 does), its tiles
through tensor descriptors (TMA) and, where Triton allows, a warp-specialized loop: the rate our paged FP8
prefill kernel (kernels/fp8_attention.py, 0.4x flash-attn-4) could reach in Triton, against flash-attn-4's bf16
on the same shapes. llama3-8b's attention shapes (32 query heads, 8 KV heads, d 128), one sequence, causal.

    python scripts/gpu_fp8_attention_ceiling.py [TOKENS ...]         default: 8192 65536
    SETTINGS="128,128,8,2,0 128,128,4,2,1" ...                        (block_m, block_n, warps, stages, warp-specialized)

Prints a table (ms, TFLOP/s, error of the FP8 output against bf16 attention over the same rounded values);
writes fp8_attention_ceiling.json under $OUT (or the working directory).
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from kernels.attention import _flash_attn_4

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_gemm_shapes import timed  # noqa: E402

H, HKV, D = 32, 8, 128
DEFAULT_SETTINGS = "128,128,8,2,0 128,128,8,3,0 128,64,4,3,0 128,128,4,2,1 128,128,4,3,1"


@triton.jit
def _fp8_attention(q_ptr, k_ptr, vt_ptr, o_ptr, qk_scale, n,
                   H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   STAGES: tl.constexpr, WS: tl.constexpr):
    """Program (query tile, head): causal attention of BM queries. q [n, H, D], k [n, HKV, D] e4m3;
    vt [HKV, D, n] e4m3 (V transposed: keys contiguous, K-major for P . V); o [n, H, D] bf16."""
    start_m = tl.program_id(0) * BM
    h = tl.program_id(1)
    g = h // (H // HKV)
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[n, H * D], strides=[H * D, 1], block_shape=[BM, D])
    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[n, HKV * D], strides=[HKV * D, 1], block_shape=[BN, D])
    v_desc = tl.make_tensor_descriptor(vt_ptr, shape=[HKV * D, n], strides=[n, 1], block_shape=[D, BN])
    o_desc = tl.make_tensor_descriptor(o_ptr, shape=[n, H * D], strides=[H * D, 1], block_shape=[BM, D])
    q = q_desc.load([start_m, h * D])                                               # [BM, D]
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    # the key tiles wholly below the diagonal: no mask
    for start_n in tl.range(0, start_m, BN, num_stages=STAGES, warp_specialize=WS):
        k = k_desc.load([start_n, g * D])                                           # [BN, D]
        s = tl.dot(q, tl.trans(k)) * qk_scale                                       # [BM, BN], base 2
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        vt = v_desc.load([g * D, start_n])                                          # [D, BN]
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), tl.trans(vt))
        m = m_new
    # the diagonal's tiles, masked
    rows = start_m + tl.arange(0, BM)
    for start_n in tl.range(start_m, start_m + BM, BN):
        k = k_desc.load([start_n, g * D])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(rows[:, None] >= start_n + tl.arange(0, BN)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        vt = v_desc.load([g * D, start_n])
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), tl.trans(vt))
        m = m_new
    o_desc.store([start_m, h * D], (acc / l[:, None]).to(tl.bfloat16))


def fp8_attention(q8, k8, vt8, scale, bm, bn, warps, stages, ws):
    n = q8.shape[0]
    out = torch.empty(n, H, D, dtype=torch.bfloat16, device=q8.device)
    _fp8_attention[(n // bm, H)](q8, k8, vt8, out, scale * 1.4426950408889634, n, H=H, HKV=HKV, D=D, BM=bm, BN=bn,
                                 STAGES=stages, WS=bool(ws), num_warps=warps, num_stages=stages)
    return out


def ms(fn) -> float:
    """Median ms of fn() over 5 calls after 2 (scripts/gpu_gemm_shapes.py's CUDA-event timing)."""
    return timed(fn, iters=5, warmup=2) * 1e3


def main(argv):
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    settings = [tuple(int(x) for x in s.split(",")) for s in os.environ.get("SETTINGS", DEFAULT_SETTINGS).split()]
    print(f"GPU: {torch.cuda.get_device_name(0)}, Triton {triton.__version__}")
    print("| tokens | kernel | block_m, block_n, warps, stages, warp-specialized | ms | TFLOP/s | rel. error vs bf16 |")
    print("|---|---|---|---|---|---|")
    rows = []
    for n in [int(a) for a in (argv or ["8192", "65536"])]:
        torch.manual_seed(0)
        q, k, v = (torch.randn(n, heads, D, device="cuda") for heads in (H, HKV, HKV))
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        vt8 = v8.permute(1, 2, 0).contiguous()                                       # [HKV, D, n]
        qb, kb, vb = (x.to(torch.bfloat16) for x in (q8, k8, v8))                    # the same values
        scale = D ** -0.5
        tflop = 4 * n * n / 2 * D * H / 1e12
        want, _ = _flash_attn_4(qb, kb, vb, True, scale)
        t = ms(lambda: _flash_attn_4(qb, kb, vb, True, scale))
        print(f"| {n} | flash-attn-4 bf16 | - | {t:.3f} | {tflop / t * 1e3:.0f} | - |", flush=True)
        rows.append({"tokens": n, "kernel": "fa4 bf16", "ms": t})
        for s in settings:
            try:
                got = fp8_attention(q8, k8, vt8, scale, *s)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                t = ms(lambda: fp8_attention(q8, k8, vt8, scale, *s))
            except Exception as e:
                print(f"| {n} | triton fp8 | {s} | - | {type(e).__name__}: {str(e)[:100]} | - |", flush=True)
                continue
            print(f"| {n} | triton fp8 | {s} | {t:.3f} | {tflop / t * 1e3:.0f} | {err:.4f} |", flush=True)
            rows.append({"tokens": n, "kernel": "triton fp8", "setting": s, "ms": t, "err": err})
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_attention_ceiling.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "triton": triton.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

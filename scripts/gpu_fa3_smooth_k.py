"""FlashAttention-3's FP8 forward (the `fa3-fwd` wheel) fed as a prefill would feed it with K smoothed: K less
its mean over the keys (per KV head and channel; q . (k_j - mean) differs from q . k_j by a constant per query,
which the softmax cancels: SageAttention's "smooth K"), then Q, K and V in e4m3 with one scale per KV head
(FA3's descales), and the LSE put back (+ scale * q . mean). Against flash-attn-4 in bf16 on the same shapes.

Why: FA3's one K scale per (batch, KV head) is 0.15 from float64 with an outlier channel in K that varies
around 0, and smoothing cannot help there; an outlier channel that is a bias shared by the tokens (what
SageAttention reports of trained models' keys) it removes (CPU emulation: scripts/fp8_attention_error.py).
This measures what the CPU cannot: FA3's own rounding and speed with the smoothing's cost, per K kind.

One layer of llama3-8b's attention (32 query heads, 8 KV heads, d 128), one sequence, dense K/V, causal
aligned to the end. For each QUERIESxKEYS and K kind (plain, an outlier channel x20, a bias channel +20):
the error of the last 256 queries (the first KV head's 4 query heads) against float64, output and LSE, for
flash-attn-4 bf16, FA3 FP8 as is, FA3 FP8 smoothed, and FA3 FP8 smoothed over K/V first rounded as the FP8
cache rounds them (kernels.kv_quant.round_kv: what a chunk's context would be, rounded twice); times
(gpu_gemm_shapes.timed: CUDA events, median of 20 after 5 warm-ups) of flash-attn-4 bf16, FA3 FP8, and the
smoothing and quantizing (torch ops, unfused) apart.

    python scripts/gpu_fa3_smooth_k.py [QUERIESxKEYS ...]     default: 8192x8192 32768x32768 8192x131072
"""
import os
import sys

import torch

from kernels.attention import _flash_attn_4
from kernels.kv_quant import round_kv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_gemm_shapes import timed  # noqa: E402

H, HKV, D = 32, 8, 128
G = H // HKV
FP8, FP8_MAX = torch.float8_e4m3fn, 448.0


def per_kv_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """x [n, heads * g, D] -> e4m3 [n, heads * g, D] and descale [1, heads] (one scale per KV head's group)."""
    n = x.shape[0]
    grouped = x.float().view(n, heads, -1, D)
    scale = grouped.abs().amax(dim=(0, 2, 3)).clamp(min=1e-12) / FP8_MAX              # [heads]
    q8 = (grouped / scale[None, :, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view_as(x)
    return q8, scale[None].contiguous()


def smooth_quantize(q, k, v, smooth: bool):
    """q [n, H, D], k, v [m, HKV, D] bf16 -> FA3's FP8 inputs, descales, and mean [HKV, D] fp32 (0: not smoothed)."""
    mean = k.float().mean(0) if smooth else torch.zeros(HKV, D, device=k.device)
    q8, qd = per_kv_head(q, HKV)
    k8, kd = per_kv_head(k.float() - mean, HKV)
    v8, vd = per_kv_head(v, HKV)
    return q8, k8, v8, qd, kd, vd, mean


def fa3_forward(f3, q8, k8, v8, qd, kd, vd):
    """One FA3 FP8 call on one sequence -> (out [n, H, D] bf16, lse [H, n] fp32 or None if it gives none)."""
    kw = dict(softmax_scale=D ** -0.5, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    try:
        res = f3.flash_attn_func(q8[None], k8[None], v8[None], return_attn_probs=True, **kw)
    except TypeError:                     # a build without the argument
        res = f3.flash_attn_func(q8[None], k8[None], v8[None], **kw)
    if isinstance(res, tuple):
        return res[0][0], (res[1][0] if len(res) > 1 and res[1] is not None else None)
    return res[0], None


def fa3_fp8(f3, q, k, v, smooth: bool):
    """-> out [n, H, D] bf16, lse [H, n] fp32 (natural log, of the softmax's scaled scores) or None."""
    q8, k8, v8, qd, kd, vd, mean = smooth_quantize(q, k, v, smooth)
    out, lse = fa3_forward(f3, q8, k8, v8, qd, kd, vd)
    if lse is None:
        return out, None
    shift = torch.einsum("nhgd,hd->hgn", q.float().view(-1, HKV, G, D), mean).reshape(H, -1) * D ** -0.5
    return out, lse.float() + shift


def float64_rows(q, k, v, rows: int):
    """The last `rows` queries of the first KV head's G query heads in float64: out [rows, G, D], lse [G, rows]."""
    n, m = q.shape[0], k.shape[0]
    qq = q[-rows:, :G].double().transpose(0, 1)                              # [G, rows, D]
    s = qq @ k[:, 0].double().T * D ** -0.5                                   # [G, rows, m]
    pos_q = torch.arange(n - rows, n, device=q.device) + (m - n)
    s = s.masked_fill(torch.arange(m, device=q.device)[None, :] > pos_q[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ v[:, 0].double()).transpose(0, 1), lse


def relative(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(argv):
    import fa3_fwd_interface as f3
    shapes = [tuple(map(int, s.split("x"))) for s in (argv or ["8192x8192", "32768x32768", "8192x131072"])]
    print(f"GPU: {torch.cuda.get_device_name(0)}; error vs float64: output (LSE, max abs)\n")
    print("| queries x keys | K | fa4 bf16 | FA3 FP8 | FA3 FP8, K smoothed | the same from the FP8 cache's values | "
          "fa4 bf16 ms | FA3 FP8 ms | smooth + quantize ms | FA3 FP8 + smoothing / fa4 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for n, m in shapes:
        q = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16)
        base = torch.randn(m, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(m, HKV, D, device="cuda", dtype=torch.bfloat16)
        channel = torch.arange(D, device="cuda") == 7
        kinds = {"plain": base, "outlier x20": base * torch.where(channel, 20.0, 1.0).bfloat16(),
                 "bias +20": base + torch.where(channel, 20.0, 0.0).bfloat16()}
        for name, k in kinds.items():
            want, want_lse = float64_rows(q, k, v, 256)
            cells = []

            def cell(out, lse):                  # lse [H, n] or None
                lse_err = f"{(lse[:G, -256:] - want_lse).abs().max():.1e}" if lse is not None else "-"
                return f"{relative(out[-256:, :G], want):.4f} ({lse_err})"
            bf16, bf16_lse = _flash_attn_4(q, k, v, True, D ** -0.5)            # lse [n, H]
            cells.append(cell(bf16, bf16_lse.transpose(0, 1)))
            for smooth in (False, True):
                cells.append(cell(*fa3_fp8(f3, q, k, v, smooth)))
            cached_k, cached_v = round_kv(k), round_kv(v)     # a chunk's context: the FP8 cache's values
            cells.append(cell(*fa3_fp8(f3, q, cached_k, cached_v, True)))
            t_fa4 = timed(lambda: _flash_attn_4(q, k, v, True, D ** -0.5))
            prepared = smooth_quantize(q, k, v, True)
            q8, k8, v8, qd, kd, vd, _ = prepared
            t_fa3 = timed(lambda: fa3_forward(f3, q8, k8, v8, qd, kd, vd))
            t_prep = timed(lambda: smooth_quantize(q, k, v, True))
            print(f"| {n}x{m} | {name} | {' | '.join(cells)} | {t_fa4 * 1e3:.2f} | {t_fa3 * 1e3:.2f} | "
                  f"{t_prep * 1e3:.2f} | {(t_fa3 + t_prep) / t_fa4:.2f} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])

"""FP8 attention's rounding error against fp64, attention output relative to fp64's, for the ways an FP8
attention kernel can be fed from the FP8 KV cache (kernels/kv_quant.py: e4m3 with a bf16 scale per token and
KV head). One head group of llama3-8b (4 query heads on a KV head, d 128), random q, k, v, causal, K plain,
with an outlier channel (one channel 20x the others), and with an outlier channel that is a bias shared by the
tokens (one channel 20 + N(0, 1); SageAttention reports trained models' K outliers as such a bias).

The ways (each emulated in plain torch; what an FP8 kernel adds is the rounding of Q and of the
probabilities P, which FlashAttention-3 casts to e4m3 after scaling them by 2^8):
- cache only: bf16-precision Q, the cache's K/V (what decode and the CPU path compute)
- FA3 as is: Q with one scale per (block, KV-head group), K/V re-quantized from the cache to one scale per
  (segment, KV head) (FA3's descales are [batch, kv_heads]), P in e4m3
- per-token Q: Q with a scale per (token, head), the cache's per-token K/V scales applied to the scores'
  columns, P in e4m3 (what a kernel of our own can do; FA3 cannot)
- FA3 fed from the model's K/V (one rounding, not the cache's twice: a prefill's own blocks), and the same
  with K's channels scaled into Q first (q_c s_c . k_c / s_c, s_c = sqrt(max |k_c| / max |q_c|): SmoothQuant's
  migration, exact before rounding)
- FA3 fed from the model's K/V less their mean over the tokens (q.k_j - q.mean(k) differs from q.k_j by a
  constant per query, which the softmax cancels: SageAttention's "smooth K"); it removes an outlier channel
  that is a bias shared by the tokens, not one that varies around 0
- each of these with a random-sign Hadamard rotation of the head dimension on Q and K before any rounding
  (q.k is unchanged; K is stored rotated; FlashAttention-3's "incoherent processing")

    python scripts/fp8_attention_error.py [TOKENS] [--parts]      (default 4096; prints a markdown table)

--parts: FA3's way from the model's K/V, and the per-token way, with one rounding at a time (Q, K, V or P
alone; Q and K), the rest exact: which rounding each way's error comes from; and the per-token way with Q
as two e4m3 parts (the second its first's remainder: two FP8 dots for Q . K).
"""
import sys

import torch

from kernels.kv_quant import FP8, FP8_MAX, round_kv


def causal_attention(q, k, v, p_round=None):
    """q [H, n, D], k, v [n, D] in fp64 -> out [H, n, D]; p_round rounds exp(s - rowmax) (in [0, 1])."""
    n = k.shape[0]
    s = q @ k.T / k.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    denominator = p.sum(-1, keepdim=True)                      # FA3 sums P in fp32 before the cast
    if p_round is not None:
        p = p_round(p)
    return (p @ v) / denominator


def fa3_p(p):
    """P scaled by 2^8, cast to e4m3, scaled back (FlashAttention-3's FP8 softmax, Max_offset 8)."""
    return (p * 256).to(FP8).double() / 256


def one_scale(x):
    """x [..., n, D] in e4m3 with one scale over its last two dimensions (a block, a segment)."""
    s = x.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=1e-30) / FP8_MAX
    return (x / s).to(FP8).double() * s


def per_row(x):
    """x [..., D] in e4m3 with one scale per row."""
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / FP8_MAX
    return (x / s).to(FP8).double() * s


def hadamard(d, seed=1):
    """A random-sign normalized Hadamard matrix [d, d] (d a power of two), orthogonal."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return signs[:, None] * h / d ** 0.5


def migrated(q, k):
    """K's per-channel range moved halfway into Q: q [H, n, D] times s, k [n, D] over s (q.k unchanged)."""
    s = (k.abs().amax(0) / q.abs().amax(dim=(0, 1)).clamp(min=1e-30)).sqrt().clamp(min=1e-6)
    return q * s, k / s


def ways(q, k, v, rotate):
    """The attention outputs of each way for fp32-precision q [H, n, D], k, v [n, D]."""
    if rotate is not None:
        q, k = q @ rotate, k @ rotate
    kc, vc = round_kv(k.float()).double(), round_kv(v.float()).double()          # the cache's values
    qm, km = migrated(q, k)
    return {"cache only (bf16 Q)": causal_attention(q.bfloat16().double(), kc, vc),
            "FA3 as is (Q per block, K/V per segment, P e4m3)":
                causal_attention(one_scale(q), one_scale(kc), one_scale(vc), fa3_p),
            "per-token Q, cache's K/V scales, P e4m3": causal_attention(per_row(q), kc, vc, fa3_p),
            "FA3 from the model's K/V (one rounding)":
                causal_attention(one_scale(q), one_scale(k), one_scale(v), fa3_p),
            "FA3 from the model's K/V, K's channels scaled into Q":
                causal_attention(one_scale(qm), one_scale(km), one_scale(v), fa3_p),
            "FA3 from the model's K/V, K's token mean subtracted":
                causal_attention(one_scale(q), one_scale(k - k.mean(0)), one_scale(v), fa3_p)}


def split_row(x):
    """x as two e4m3 parts with a scale per row each, the second its first's remainder (two FP8 dots)."""
    hi = per_row(x)
    return hi + per_row(x - hi)


def parts(q, k, v, rotate):
    """FA3's way from the model's K/V, then the per-token way (kernels/fp8_attention.py), one rounding at a
    time (the others exact): which one makes each way's error; and Q split into two e4m3 parts."""
    if rotate is not None:
        q, k = q @ rotate, k @ rotate
    kc, vc = round_kv(k.float()).double(), round_kv(v.float()).double()          # the cache's values
    return {"FA3's rounding of Q alone (one scale per block)": causal_attention(one_scale(q), k, v),
            "FA3's rounding of K alone (one scale per segment)": causal_attention(q, one_scale(k), v),
            "FA3's rounding of V alone (one scale per segment)": causal_attention(q, k, one_scale(v)),
            "FA3's rounding of P alone (e4m3, times 2^8)": causal_attention(q, k, v, fa3_p),
            "FA3's rounding of Q and K (scores), P and V exact": causal_attention(one_scale(q), one_scale(k), v),
            "per-token way: Q alone (a scale per token and head)": causal_attention(per_row(q), k, v),
            "per-token way: K alone (the cache's)": causal_attention(q, kc, v),
            "per-token way: V alone (the cache's)": causal_attention(q, k, vc),
            "per-token way, all (our kernel's)": causal_attention(per_row(q), kc, vc, fa3_p),
            "per-token way, all, Q in two e4m3 parts": causal_attention(split_row(q), kc, vc, fa3_p)}


def main(argv):
    split = "--parts" in argv
    argv = [a for a in argv if a != "--parts"]
    n, h, d = int(argv[0]) if argv else 4096, 4, 128
    torch.manual_seed(0)
    rotation = hadamard(d)
    rows: dict[str, list[float]] = {}
    for _ in range(3):
        q, k, v = torch.randn(h, n, d).double(), torch.randn(n, d).double(), torch.randn(n, d).double()
        channel = torch.arange(d) == 7
        for j, kk in enumerate((k, k * torch.where(channel, 20.0, 1.0), k + torch.where(channel, 20.0, 0.0))):
            want = causal_attention(q, kk, v)
            for rotate, tag in ((None, ""), (rotation, ", Hadamard on Q, K")):
                for name, got in (parts if split else ways)(q, kk, v, rotate).items():
                    row = rows.setdefault(name + tag, [0.0, 0.0, 0.0])
                    row[j] = max(row[j], ((got - want).norm() / want.norm()).item())
    print(f"| way | rel. error, plain K | K with an outlier channel (x20) | K with a bias channel (+20) |  "
          f"({n} tokens, 3 draws, max)")
    print("|---|---|---|---|")
    for name, (plain, outlier, bias) in rows.items():
        print(f"| {name} | {plain:.4f} | {outlier:.4f} | {bias:.4f} |")


if __name__ == "__main__":
    main(sys.argv[1:])

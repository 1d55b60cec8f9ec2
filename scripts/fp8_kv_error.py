"""The FP8 KV cache's rounding error (kernels/kv_quant.py) against fp32, attention output relative to fp32's, the
issue-35 yardstick's shape (one head group of llama3-8b: 4 query heads on a KV head, d 128; random q, k, v):
bf16 K/V; FP8 with the cache's bf16 scale amax / 448 per (token, KV head); with an fp32 scale amax / 448; with a
power-of-two scale per (token, KV head) (the format's first version); with one scale per KV head; each with and without an outlier channel in K (one channel 20x the
others, as trained models' keys have). Plain torch on the CPU: the same figures on any machine.

    python scripts/fp8_kv_error.py [TOKENS]      (default 4096; prints a markdown table)
"""
import sys

import torch

from kernels.kv_quant import FP8, FP8_MAX, round_kv


def attention(q, k, v):
    """q [H, n, D], k, v [n, D] (one KV head, causal) in fp64 -> out [H, n, D]."""
    n = k.shape[0]
    s = q @ k.T / k.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def exact_scale(x):
    """FP8 with one scale amax / 448 per row (not a power of two)."""
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / FP8_MAX
    return (x / s).to(FP8).float() * s


def power_of_two(x):
    """FP8 with the smallest power-of-two scale that brings each row's largest magnitude to at most 448."""
    m, k = torch.frexp(x.abs().amax(-1, keepdim=True))
    e = k - 9 + (m > 0.875).to(torch.int32)
    return torch.ldexp(torch.ldexp(x, -e).to(FP8).float(), e)


def per_head(x):
    """FP8 with one scale for the whole head (every token)."""
    s = x.abs().amax().clamp(min=1e-30) / FP8_MAX
    return (x / s).to(FP8).float() * s


def main(argv):
    n, h, d = int(argv[0]) if argv else 4096, 4, 128
    torch.manual_seed(0)
    roundings = {"bf16": lambda x: x.bfloat16().float(),
                 "FP8, bf16 scale amax/448 per token (kernels/kv_quant.py)": round_kv,
                 "FP8, fp32 scale amax/448 per token": exact_scale,
                 "FP8, power-of-two scale per token": power_of_two, "FP8, one scale per head": per_head}
    print(f"| K/V as | rel. error, plain K | rel. error, K with an outlier channel |  ({n} tokens, 5 draws, max)")
    print("|---|---|---|")
    rows = {name: [0.0, 0.0] for name in roundings}
    for _ in range(5):
        q, k, v = torch.randn(h, n, d), torch.randn(n, d), torch.randn(n, d)
        for j, kk in enumerate((k, k * torch.where(torch.arange(d) == 7, 20.0, 1.0))):
            want = attention(q.double(), kk.double(), v.double())
            for name, rnd in roundings.items():
                got = attention(q.double(), rnd(kk).double(), rnd(v).double())
                rows[name][j] = max(rows[name][j], ((got - want).norm() / want.norm()).item())
    for name, (plain, outlier) in rows.items():
        print(f"| {name} | {plain:.4f} | {outlier:.4f} |")


if __name__ == "__main__":
    main(sys.argv[1:])

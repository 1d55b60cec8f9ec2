"""One-off probe (issue 53): llama3-8b's four FP8 GEMMs at M rows with row-wise scales (the engine's) against
one scale a tensor (cuBLASLt's own FP8 path), both with fast sums; bf16 F.linear beside. Usage: python
scripts/probe_gemm_scaling.py [M ...]"""
import sys

import torch
import torch.nn.functional as F

from gpu_gemm_shapes import SHAPES, timed


def main() -> None:
    dev = torch.device("cuda:0")
    rows = [int(m) for m in sys.argv[1:]] or [8192]
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
    print("| M | linear | bf16 us | row-wise us | TFLOP/s | tensor-wise us | TFLOP/s | tensor / row |")
    print("|---|---|---|---|---|---|---|---|")
    for m in rows:
        tot = [0.0, 0.0, 0.0]
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            xq, wq = x.to(torch.float8_e4m3fn), (w * 50).to(torch.float8_e4m3fn)
            xs = torch.rand(m, 1, device=dev) + 0.5
            ws = torch.rand(1, n, device=dev) + 0.5
            one = torch.ones((), device=dev)
            fns = [lambda: F.linear(x, w),
                   lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16,
                                            use_fast_accum=True),
                   lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                            use_fast_accum=True)]
            t = [timed(f) for f in fns]
            for i in range(3):
                tot[i] += t[i]
            flop = 2 * m * n * k
            print(f"| {m} | {name} | {t[0] * 1e6:.0f} | {t[1] * 1e6:.0f} | {flop / t[1] / 1e12:.0f} | {t[2] * 1e6:.0f} | "
                  f"{flop / t[2] / 1e12:.0f} | {t[2] / t[1]:.3f} |", flush=True)
        flop = 2 * m * sum(n * k for n, k in SHAPES.values())
        print(f"| {m} | one layer | {tot[0] * 1e6:.0f} | {tot[1] * 1e6:.0f} | {flop / tot[1] / 1e12:.0f} | "
              f"{tot[2] * 1e6:.0f} | {flop / tot[2] / 1e12:.0f} | {tot[2] / tot[1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()

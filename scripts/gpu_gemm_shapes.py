"""The prefill's linear layers alone, by shape and weight layout, on one GPU: how far cuBLAS is from its
8192^3 rate at the row counts a worker sees (issue 13: 8K tokens on 2 GPUs is 4K rows a worker).

llama3-8b's four linears (qkv, o, gate_up, down), bf16, M rows, timed with CUDA events (median of 20
after 5 warm-ups) as the engine calls them (F.linear: x [M, K] times the stored weight [N, K]
transposed) and with the weight stored transposed ([K, N], x @ w). Prints a markdown table; run it
once per CUBLASLT_WORKSPACE_SIZE setting to compare.

--fp8: the same four shapes as `-q fp8` runs them (kernels/fp8.py: x per token, w per output channel, both
scales in torch._scaled_mm), with the MMAs' sums moved into fp32 every 128 products (use_fast_accum off,
the engine's) and kept in the tensor cores' narrower sums (use_fast_accum on, vLLM's CUTLASS kernels' way
on sm_90): time, and each product's relative error (Frobenius) against the same FP8 operands multiplied
in fp64, beside the bf16 output's own rounding (2^-9).

Usage: python scripts/gpu_gemm_shapes.py [--fp8] [M ...]   (default 2048 4096 8192 32768)"""
import os
import sys

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}   # [N, K]


def timed(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median seconds of fn() on the current stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def fp8_accumulation(rows: list[int], dev: torch.device) -> None:
    """--fp8: see the module docstring."""
    from burstserve.kernels.fp8 import quantize_rows, quantize_weight
    print("| M | linear | fp32 sums us | TFLOP/s | error | fast sums us | TFLOP/s | error | fast / fp32 time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in rows:
        totals = [0.0, 0.0]
        for name, (n, k) in SHAPES.items():
            xq, xs = quantize_rows(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            w = quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
            sample = slice(0, min(m, 1024))                        # fp64 reference on the first rows
            exact = (xq[sample].double() * xs[sample].double()) @ (w.weight.double() * w.scale.double().t()).t()
            cells = []
            for i, fast in enumerate((False, True)):
                def run():
                    return torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.scale, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)
                t = timed(run)
                totals[i] += t
                err = ((run()[sample].double() - exact).norm() / exact.norm()).item()
                cells.append((t, 2 * m * n * k / t / 1e12, err))
            (a, fa, ea), (b, fb, eb) = cells
            print(f"| {m} | {name} | {a * 1e6:.0f} | {fa:.0f} | {ea:.2e} | {b * 1e6:.0f} | {fb:.0f} | {eb:.2e} | "
                  f"{b / a:.3f} |", flush=True)
        layer = 2 * m * sum(n * k for n, k in SHAPES.values())
        a, b = totals
        print(f"| {m} | one layer | {a * 1e6:.0f} | {layer / a / 1e12:.0f} | | {b * 1e6:.0f} | {layer / b / 1e12:.0f} "
              f"| | {b / a:.3f} |", flush=True)


def main() -> None:
    args = sys.argv[1:]
    fp8 = "--fp8" in args
    rows = [int(m) for m in args if m != "--fp8"] or [2048, 4096, 8192, 32768]
    if fp8:
        return fp8_accumulation(rows, torch.device("cuda:0"))
    dev = torch.device("cuda:0")
    square = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    peak = 2 * 8192 ** 3 / timed(lambda: square @ square) / 1e12
    print(f"CUBLASLT_WORKSPACE_SIZE={os.environ.get('CUBLASLT_WORKSPACE_SIZE', '(default)')}; "
          f"bf16 8192^3: {peak:.0f} TFLOP/s")
    print("| M | linear | F.linear (w [N, K]) us | TFLOP/s | x @ w (w [K, N]) us | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    totals = {}
    for m in rows:
        x_by_k = {}
        for name, (n, k) in SHAPES.items():
            x = x_by_k.setdefault(k, torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            wt = w.t().contiguous()
            flop = 2 * m * n * k
            a, b = timed(lambda: F.linear(x, w)), timed(lambda: x @ wt)
            totals.setdefault(m, [0.0, 0.0])
            totals[m][0] += a
            totals[m][1] += b
            print(f"| {m} | {name} | {a * 1e6:.0f} | {flop / a / 1e12:.0f} | {b * 1e6:.0f} | {flop / b / 1e12:.0f} |")
            del w, wt
        layer_flop = 2 * m * sum(n * k for n, k in SHAPES.values())
        a, b = totals[m]
        print(f"| {m} | one layer | {a * 1e6:.0f} | {layer_flop / a / 1e12:.0f} | {b * 1e6:.0f} | "
              f"{layer_flop / b / 1e12:.0f} |", flush=True)


if __name__ == "__main__":
    main()

"""The prefill's linear layers alone, by shape and weight layout, on one GPU: how far cuBLAS is from its
8192^3 rate at the row counts a worker sees (issue 13: 8K tokens on 2 GPUs is 4K rows a worker).

llama3-8b's four linears (qkv, o, gate_up, down), bf16, M rows, timed with CUDA events (median of 20
after 5 warm-ups) as the engine calls them (F.linear: x [M, K] times the stored weight [N, K]
transposed) and with the weight stored transposed ([K, N], x @ w). Prints a markdown table; run it
once per CUBLASLT_WORKSPACE_SIZE setting to compare.

Usage: python scripts/gpu_gemm_shapes.py [M ...]   (default 2048 4096 8192 32768)"""
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


def main() -> None:
    rows = [int(m) for m in sys.argv[1:]] or [2048, 4096, 8192, 32768]
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

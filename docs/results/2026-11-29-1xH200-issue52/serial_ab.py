"""kernels/fp8_small_gemm.py's launch option `serial` (a split's partials summed by the run that finishes last)
against its default (a second kernel sums them) and cuBLAS's torch._scaled_mm, on llama3-8b's decode linears
(M rows, [N, K] FP8 weights), each timed as CUDA-graph replays of 8 distinct weights (past the L2) a graph.

    python docs/results/2026-11-29-1xH200-issue52/serial_ab.py        (one GPU; prints a markdown table)
"""
import torch

from kernels import fp8
from kernels import fp8_small_gemm as sg

dev, bf = torch.device("cuda:0"), torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 8


def replay_us(fn, iters=50) -> float:
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / iters / COPIES


def main() -> None:
    print(torch.cuda.get_device_name(0))
    print("| linear | M | default us | serial us | cuBLAS us | serial/default | default GB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        ws = [fp8.quantize_weight(torch.randn(n, k, device=dev, dtype=bf) * 0.02) for _ in range(COPIES)]
        for m in (1, 8, 16, 64):
            xq, xs = fp8.quantize_rows(torch.randn(m, k, device=dev, dtype=bf))
            same = sg.scaled_mm_few_rows(xq, xs, ws[0], None, bf)
            assert same is not None, "the Triton kernel declined or failed"
            if not torch.equal(same, sg.scaled_mm_few_rows(xq, xs, ws[0], None, bf, serial=True)):
                print(f"(serial differs from default at {name} M={m})")
            t = {}
            for label, run in (("default", lambda w: sg.scaled_mm_few_rows(xq, xs, w, None, bf)),
                               ("serial", lambda w: sg.scaled_mm_few_rows(xq, xs, w, None, bf, serial=True)),
                               ("cublas", lambda w: torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.scale,
                                                                    out_dtype=bf))):
                t[label] = replay_us(lambda: [run(w) for w in ws])
            gbs = n * k / t["default"] / 1e3
            print(f"| {name} {n}x{k} | {m} | {t['default']:.1f} | {t['serial']:.1f} | {t['cublas']:.1f} | "
                  f"{t['serial'] / t['default']:.3f} | {gbs:.0f} |", flush=True)


if __name__ == "__main__":
    main()

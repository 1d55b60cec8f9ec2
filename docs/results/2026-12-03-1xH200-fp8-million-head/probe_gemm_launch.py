"""Session probe (issue 53): kernels/fp8_small_gemm.py's launch settings at a decode step's rows on llama3-8b's
four linear shapes, beside torch._scaled_mm and bf16 F.linear. Each weight one of several copies (>= 256 MB),
one call a copy in a CUDA graph (no L2 hits). Prints us a call (TB/s) and the step's linears (x 32 layers);
the last line names the best setting by the sum of the M's step times: BEST=bn,bk,stages,warps,waves.
    SETTINGS="64,256,3,4,3 ..." python scripts/probe_gemm_launch.py [M ...]
"""
import os
import sys

import torch
import torch.nn.functional as F

from kernels import fp8
from kernels import fp8_small_gemm as sg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_gemm_shapes import timed  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}   # (N, K)
LAYERS = 32
DEFAULT = ("64,256,3,4,3 64,256,4,4,3 64,256,3,4,4 64,256,4,4,2 64,256,2,4,4 64,512,2,4,3 64,512,3,4,2 "
           "64,128,4,4,3 64,128,6,4,3 128,256,3,4,2 128,256,2,8,3 64,256,3,4,6 64,256,4,4,4 64,128,8,4,2")
DEV = torch.device("cuda:0")


def graphed_per_call(calls) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return min(timed(graph.replay, iters=20, warmup=3) for _ in range(2)) / len(calls)


def main(argv):
    rows = [int(a) for a in argv] or [1, 16]
    settings = [tuple(int(v) for v in s.split(",")) for s in os.environ.get("SETTINGS", DEFAULT).split()]
    print(f"GPU: {torch.cuda.get_device_name(DEV)}; torch {torch.__version__}")
    steps = {}
    for m in rows:
        table = {}
        for name, (n, k) in SHAPES.items():
            copies = max(2, -(-256 * 2**20 // (n * k)))
            bf16 = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            q8 = [fp8.quantize_weight(w) for w in bf16]
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            xq, xs = fp8.quantize_rows(x)
            runs = {"bf16 F.linear": [lambda w=w: F.linear(x, w) for w in bf16],
                    "fp8 torch._scaled_mm": [lambda w=w: torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.scale,
                                                                          out_dtype=torch.bfloat16) for w in q8]}
            for st in settings:
                runs["ours " + ",".join(map(str, st))] = [
                    lambda w=w, a=st: sg._launch(sg._triton.kernels(DEV), xq, xs, w.weight, w.scale, None,
                                                 torch.bfloat16, block_n=a[0], block_k=a[1], stages=a[2],
                                                 warps=a[3], waves=a[4]) for w in q8]
            want = torch._scaled_mm(xq, q8[0].weight.t(), scale_a=xs, scale_b=q8[0].scale, out_dtype=torch.bfloat16)
            for label, calls in runs.items():
                try:
                    if label.startswith("ours"):
                        got = calls[0]()
                        if got is None or not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=1e-2):
                            table.setdefault(label, {})[name] = float("nan")
                            continue
                    table.setdefault(label, {})[name] = graphed_per_call(calls)
                except Exception as e:       # a setting Triton cannot build (shared memory)
                    print(f"{label} {name}: {type(e).__name__}: {str(e)[:120]}")
                    table.setdefault(label, {})[name] = float("nan")
            del bf16, q8
            torch.cuda.empty_cache()
        print(f"\nM = {m}: us a call (weight TB/s); step = the four x {LAYERS}")
        print("| kernel | " + " | ".join(SHAPES) + " | step ms |")
        print("|---|" + "---|" * (len(SHAPES) + 1))
        for label, by in table.items():
            cells = []
            for name, (n, k) in SHAPES.items():
                s = by.get(name, float("nan"))
                nbytes = n * k * (2 if label.startswith("bf16") else 1)
                cells.append(f"{s * 1e6:.1f} ({nbytes / s / 1e12:.2f})" if s == s else "failed")
            step = sum(by.values()) * LAYERS * 1e3
            print(f"| {label} | " + " | ".join(cells) + f" | {step:.3f} |")
            if label.startswith("ours "):
                steps[label[5:]] = steps.get(label[5:], 0.0) + step
    good = {k: v for k, v in steps.items() if v == v}
    best = min(good, key=good.get)
    print(f"\nsum of step ms over M {rows}: " + "; ".join(f"{k} {v:.3f}" for k, v in sorted(good.items(), key=lambda kv: kv[1])))
    print(f"BEST={best}")


if __name__ == "__main__":
    main(sys.argv[1:])

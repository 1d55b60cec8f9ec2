"""FP8 linear layers at a decode step's row counts: kernels/fp8_small_gemm.py (its launch settings) against
torch._scaled_mm (cuBLAS, what --quantization fp8 ran before) and bf16 F.linear (cuBLAS's split-K GEMVs),
on llama3-8b's four linear shapes. Each weight is one of several copies (over 256 MB in all), one call per
copy in a CUDA graph, so no call finds its weight in L2; time per call = the graph's time / copies.

    python scripts/gpu_fp8_gemm.py [M ...]            default: 1 16 64
    SETTINGS="64,256,3,4,3 64,256,3,4,3,1" python scripts/gpu_fp8_gemm.py
        (block_n,block_k,stages,warps,waves[,serial]: 1 = a split's partials summed by its last run)

Prints a table per M (us a call and the weight's TB/s; the four summed, x 32 layers = a decode step's
linears); writes fp8_gemm.json under $OUT (or the working directory).
"""
import json
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
DEFAULT_SETTINGS = "64,256,3,4,3 64,256,3,4,3,1 64,128,4,4,2 64,256,4,4,4 128,256,3,8,2 32,256,4,4,2"
DEV = torch.device("cuda:0")


def graphed_per_call(calls) -> float:
    """Seconds a call: the calls (one per weight copy) captured in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:                                  # warm up (Triton compiles, cuBLAS picks) off the graph
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return timed(graph.replay, iters=20, warmup=3) / len(calls)


def settings() -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in s.split(",")) for s in os.environ.get("SETTINGS", DEFAULT_SETTINGS).split()]


def main(argv: list[str]) -> None:
    rows = [int(a) for a in argv] or [1, 16, 64]
    props = torch.cuda.get_device_properties(DEV)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    results = []
    for m in rows:
        table: dict[str, dict[str, float]] = {}
        for name, (n, k) in SHAPES.items():
            copies = max(2, -(-256 * 2**20 // (n * k)))
            bf16 = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            q8 = [fp8.quantize_weight(w) for w in bf16]
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            xq, xs = fp8.quantize_rows(x)
            runs = {"bf16 F.linear": [lambda w=w: F.linear(x, w) for w in bf16],
                    "fp8 torch._scaled_mm": [lambda w=w: torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.scale,
                                                                          out_dtype=torch.bfloat16) for w in q8]}
            for setting in settings():
                bn, bk, st, wp, wv, serial = (setting + (0,))[:6]
                runs[f"ours {','.join(map(str, setting))}"] = [
                    lambda w=w, a=(bn, bk, st, wp, wv, serial): sg._launch(
                        sg._triton.kernels(DEV), xq, xs, w.weight, w.scale, None, torch.bfloat16, block_n=a[0],
                        block_k=a[1], stages=a[2], warps=a[3], waves=a[4], serial=bool(a[5])) for w in q8]
            want = torch._scaled_mm(xq, q8[0].weight.t(), scale_a=xs, scale_b=q8[0].scale, out_dtype=torch.bfloat16)
            for label, calls in runs.items():
                if label.startswith("ours"):
                    got = calls[0]()
                    if got is None or not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=1e-2):
                        table.setdefault(label, {})[name] = float("nan")
                        continue
                seconds = graphed_per_call(calls)
                table.setdefault(label, {})[name] = seconds
            del bf16, q8
            torch.cuda.empty_cache()
        print(f"\nM = {m}: us a call (weight TB/s; bf16 rows over 2 bytes a weight); step = the four x {LAYERS}")
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
            results.append({"m": m, "kernel": label, **{f"{k}_s": v for k, v in by.items()}, "step_ms": step})
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_gemm.json"), "w") as f:
        json.dump({"gpu": props.name, "results": results}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

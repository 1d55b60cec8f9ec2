"""Does ptxas schedule our FP8 kernels better when their name contains "cutlass"? ptxas special-cases kernel
names with that word (triton-lang/triton#7298: its Gluon attention tutorial names its FP8 kernel so, "up to
150 TFLOPS faster"). Compiled for sm_90 on the CPU machine, our decode and prefill kernels' SASS changes with
the name (the few-rows GEMM's does not). This times each kernel as it is and renamed, the same arguments,
each way twice in turn (a shape's first timing runs slow), and checks that the outputs are the same bits.
Measured on an H100 (docs/results/log.md, "FP8 kernels named cutlass_*"): no gain, so the kernels keep
their names.

    python scripts/gpu_kernel_names.py [decode|prefill ...]      default: both

decode: kernels/fp8_paged_attention.py at 1 x 128K, 16 x 8K, 1 x 1M (CUDA graphs, us a layer), flash-attn-4's
bf16 paged decode beside it. prefill: kernels/fp8_attention.py (V transposed, Q as one and as two e4m3 parts)
at 8K x 8K and 64K x 64K (CUDA events, ms and TFLOP/s), flash-attn-4 bf16 beside it. Run with
TRITON_ALWAYS_COMPILE=1 (set here if unset): Triton's cache key does not hold the name. Writes
kernel_names.json under $OUT (or the working directory).
"""
import json
import os
import sys

os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")

import torch  # noqa: E402

from kernels import fp8_attention as fa  # noqa: E402
from kernels import fp8_paged_attention as fpa  # noqa: E402
from kernels.paged_attention import paged_attention  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_fp8_prefill as gp  # noqa: E402
from gpu_fp8_decode import D, make  # noqa: E402
from gpu_kernel_timing import graph_us  # noqa: E402

NAME = "cutlass_"


def built(module, key: str, renamed: bool):
    """A fresh jit of module's kernel; renamed: its compiled name prefixed with NAME."""
    kernel = module._build()[key]
    if renamed:
        kernel._repr = lambda _, n=NAME + key + "_kernel": n
    return kernel


def compiled_names(kernel) -> list[str]:
    """The names of what the kernel compiled to (checks that the rename took)."""
    names = []
    for cache in kernel.device_caches.values():
        names += [getattr(c, "name", "?") for c in cache[0].values()]
    return names


def decode(rows):
    print("| batch x context | way | us (first) | us (second) | max abs diff from as is |")
    print("|---|---|---|---|---|")
    plain, named = built(fpa, "decode", False), built(fpa, "decode", True)
    for b, n in [(1, 131072), (16, 8192), (1, 1048576)]:
        q, ((k8, kb), (v8, vb)), table, lens = make(b, n)
        cu = torch.arange(b + 1, dtype=torch.int32, device="cuda")
        ways = {"as is": lambda: fpa._decode_triton(plain, q, k8, v8, table, lens, D ** -0.5, None),
                NAME + "named": lambda: fpa._decode_triton(named, q, k8, v8, table, lens, D ** -0.5, None),
                "flash-attn-4 bf16": lambda: paged_attention(q, kb, vb, table, cu, lens, D ** -0.5, causal=False,
                                                             max_seqlen_q=1)}
        times = {w: [] for w in ways}
        outs = {}
        for _ in range(2):
            for w, fn in ways.items():
                us, (out, _) = graph_us(fn)
                times[w].append(us)
                outs[w] = out.float()
        for w in ways:
            diff = (outs[w] - outs["as is"]).abs().max().item()
            print(f"| {b} x {n} | {w} | {times[w][0]:.1f} | {times[w][1]:.1f} | {diff:.1e} |", flush=True)
            rows.append({"kernel": "decode", "batch": b, "context": n, "way": w, "us": times[w], "diff": diff})
    print(f"compiled: {compiled_names(plain)} / {compiled_names(named)}\n")


def prefill(rows):
    print("| queries x keys | way | ms (first) | ms (second) | TFLOP/s (best) | max abs diff from as is |")
    print("|---|---|---|---|---|---|")
    plain, named = built(fa, "prefill", False), built(fa, "prefill", True)
    scale = gp.D ** -0.5
    for m, n in [(8192, 8192), (65536, 65536)]:
        q, ((k8, kb), (v8, vb)), table, cu, lens = gp.make(m, n)
        v8t = v8._replace(data=v8.data.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2))
        gflop = gp.flops(m, n) / 1e9

        def ours(kernel, q_split):
            return fa._prefill_triton(kernel, q, k8, v8t, table, cu, lens, scale, True, m, q_split=q_split)
        ways = {"as is": lambda: ours(plain, False), NAME + "named": lambda: ours(named, False),
                "as is, Q in two parts": lambda: ours(plain, True),
                NAME + "named, Q in two parts": lambda: ours(named, True),
                "flash-attn-4 bf16": lambda: paged_attention(q, kb, vb, table, cu, lens, scale, causal=True,
                                                             backend="fa4", max_seqlen_q=m)}
        times = {w: [] for w in ways}
        outs = {}
        for _ in range(2):
            for w, fn in ways.items():
                times[w].append(gp.seconds(fn))
                outs[w] = fn()[0].float()
        for w in ways:
            base = outs["as is, Q in two parts" if "two parts" in w else "as is"]
            diff = (outs[w] - base).abs().max().item()
            best = min(times[w])
            print(f"| {m} x {n} | {w} | {times[w][0] * 1e3:.2f} | {times[w][1] * 1e3:.2f} | {gflop / best / 1e3:.0f} | "
                  f"{diff:.1e} |", flush=True)
            rows.append({"kernel": "prefill", "queries": m, "keys": n, "way": w, "s": times[w], "diff": diff})
    print(f"compiled: {compiled_names(plain)} / {compiled_names(named)}\n")


def main(argv):
    print(f"GPU: {torch.cuda.get_device_name(0)}")
    rows = []
    for part in argv or ["decode", "prefill"]:
        {"decode": decode, "prefill": prefill}[part](rows)
    with open(os.path.join(os.environ.get("OUT", "."), "kernel_names.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

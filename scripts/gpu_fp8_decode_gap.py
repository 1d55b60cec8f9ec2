"""Why kernels/fp8_paged_attention.py's decode kernel timed 5-13% behind scripts/gpu_fp8_decode_variants.py's
`kt_ahead` at the same launch (2 warps, 3 stages, 64 keys, 4 waves): the kernel as the engine calls it; with
66 splits (the variant's count; the kernel caps at MAX_SPLITS = 64); compiled with every integer argument
specialized (the kernel leaves five unspecialized); and the variant, each timed twice in turn (CUDA graphs).

    python scripts/gpu_fp8_decode_gap.py [BATCHxCONTEXT ...]      default: 1x131072 16x8192 1x1048576
"""
import os
import sys

import torch
import triton

from kernels import fp8_paged_attention as fpa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_fp8_decode_variants as gv  # noqa: E402
from gpu_fp8_decode import D, make  # noqa: E402
from gpu_kernel_timing import graph_us  # noqa: E402


def specialized_kernel():
    """The decode kernel jitted without its do_not_specialize list."""
    jit = triton.jit

    def jit_all(fn=None, **kw):
        kw.pop("do_not_specialize", None)
        return jit(fn, **kw) if fn is not None else jit(**kw)
    triton.jit = jit_all
    try:
        return fpa._build()["decode"]
    finally:
        triton.jit = jit


def main(argv):
    spec = specialized_kernel()
    print("| batch x context | way | us (first) | us (second) |")
    print("|---|---|---|---|")
    for b, n in [tuple(int(x) for x in a.split("x")) for a in (argv or ["1x131072", "16x8192", "1x1048576"])]:
        q, ((k8, _), (v8, _)), table, lens = make(b, n)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        splits66 = max(1, min(4 * sms // (b * 8), table.shape[1] * 128 // 256))
        ways = {
            "kernel": lambda: fpa.fp8_paged_decode(q, k8, v8, table, lens, D ** -0.5),
            f"kernel, {splits66} splits": lambda: fpa.fp8_paged_decode(q, k8, v8, table, lens, D ** -0.5, splits66),
            "kernel specialized": lambda: fpa._decode_triton(spec, q, k8, v8, table, lens, D ** -0.5, None),
            f"kernel specialized, {splits66} splits": lambda: fpa._decode_triton(spec, q, k8, v8, table, lens,
                                                                                 D ** -0.5, splits66),
            "variant kt_ahead": lambda: gv.launch("kt_ahead", q, k8, v8, None, None, table, lens, 2, 3, 64, 4),
        }
        times = {k: [] for k in ways}
        for _ in range(2):
            for k, f in ways.items():
                times[k].append(graph_us(f)[0])
        for k, t in times.items():
            print(f"| {b} x {n} | {k} | {t[0]:.1f} | {t[1]:.1f} |", flush=True)
        ways = times = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])

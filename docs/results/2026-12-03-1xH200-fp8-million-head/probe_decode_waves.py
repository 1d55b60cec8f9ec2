"""Session probe (issue 53): the FP8 decode kernel's programs a sequence and KV head (waves of 132 SMs) by context,
MAX_SPLITS lifted; each launch timed twice in turn (a shape's first timing runs slow). us a call, CUDA graph.
    python scripts/probe_decode_waves.py [BATCHxCONTEXT ...]
"""
import os
import sys

import torch

from kernels import fp8_paged_attention as fpa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_fp8_decode import D, HKV, BS, graph_time, make  # noqa: E402

LAUNCHES = [(2, 2, w) for w in (4, 6, 8, 12, 16, 24)] + [(2, 3, 4), (2, 3, 8)]    # warps, stages, waves


def main(argv):
    shapes = [tuple(int(x) for x in a.split("x")) for a in (argv or ["1x131072", "16x8192", "1x1048576"])]
    fpa.MAX_SPLITS = 1024
    kern = fpa._triton.kernels(torch.device("cuda"))["decode"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("| batch x context | warps | stages | waves | splits | us (first) | us (second) |")
    print("|---|---|---|---|---|---|---|")
    for b, n in shapes:
        q, ((k8, _), (v8, _)), table, lens = make(b, n)
        ref, _ = fpa._decode_triton(kern, q, k8, v8, table, lens, D ** -0.5, None)
        times = {}
        for rnd in range(2):
            for w, st, wv in LAUNCHES:
                fn = lambda: fpa._decode_triton(kern, q, k8, v8, table, lens, D ** -0.5, None, num_warps=w,
                                                num_stages=st, waves=wv)
                if rnd == 0:
                    assert (fn()[0].float() - ref.float()).abs().max().item() < 1e-2
                times.setdefault((w, st, wv), []).append(graph_time(fn) * 1e6)
        for (w, st, wv), t in times.items():
            splits = fpa.choose_splits(b, HKV, table.shape[1] * BS, sms, wv)
            print(f"| {b} x {n} | {w} | {st} | {wv} | {splits} | {t[0]:.1f} | {t[1]:.1f} |", flush=True)
        del q, k8, v8, table
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])

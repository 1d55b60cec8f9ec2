"""An A/B of kernels/fp8_paged_attention.py's launch options: each option set timed in turn, twice (CUDA
graphs; a shape's first timing runs slow), at llama3-8b's attention shapes (one layer), and each set's output
compared to the first's.

    OPTIONS='{"as is": {}, "stages 2": {"num_stages": 2}}' python scripts/gpu_fp8_decode_ab.py [BxN ...]
    default shapes: 1x131072 16x8192 1x1048576

Prints a table; writes fp8_decode_ab.json under $OUT (or the working directory).
"""
import json
import os
import sys

import torch

from kernels import fp8_paged_attention as fpa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_fp8_decode import D, make  # noqa: E402
from gpu_kernel_timing import graph_us  # noqa: E402


def main(argv):
    options = json.loads(os.environ.get("OPTIONS", '{"as is": {}}'))
    shapes = [tuple(int(x) for x in a.split("x")) for a in (argv or ["1x131072", "16x8192", "1x1048576"])]
    print(f"GPU: {torch.cuda.get_device_name(0)}")
    print("| batch x context | options | us (first) | us (second) | max abs diff from the first |")
    print("|---|---|---|---|---|")
    rows = []
    for b, n in shapes:
        q, ((k8, _), (v8, _)), table, lens = make(b, n)
        times = {name: [] for name in options}
        outs = {}
        for _ in range(2):
            for name, opts in options.items():
                us, (out, _) = graph_us(lambda: fpa.fp8_paged_decode(q, k8, v8, table, lens, D ** -0.5, **opts))
                times[name].append(us)
                outs[name] = out.float()
        first = outs[next(iter(options))]
        for name in options:
            diff = (outs[name] - first).abs().max().item()
            print(f"| {b} x {n} | {name} | {times[name][0]:.1f} | {times[name][1]:.1f} | {diff:.1e} |", flush=True)
            rows.append({"batch": b, "context": n, "options": name, "us": times[name], "diff": diff})
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_decode_ab.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "options": options, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

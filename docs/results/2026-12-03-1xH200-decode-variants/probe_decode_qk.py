"""Session probe (issue 53): the FP8 decode kernel with Q @ K^T (the tree) against K @ Q^T (the tree before, its
source patched back), and a few launches of the new one. us a call, CUDA graph replay, each launch timed twice in
turn; the error against the reference (small shapes) and against the kernel before (all shapes).
    python scripts/probe_decode_qk.py [BATCHxCONTEXT ...]
Writes "qk" or "before" to /tmp/decode_winner (the faster at the last shape, default launch).
"""
import importlib.util
import os
import sys

import torch

from kernels import fp8_paged_attention as fpa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_fp8_decode import D, HKV, BS, graph_time, make  # noqa: E402

NEW = "scores = tl.dot(q, tl.trans(k)) * (k_scale * scale2)[None, :]"
OLD = "scores = tl.trans(tl.dot(k, tl.trans(q))) * (k_scale * scale2)[None, :]"
# name, module, (warps, stages, waves, keys a tile)
LAUNCHES = [("before", "old", (2, 2, 4, 64)), ("qk", "new", (2, 2, 4, 64)), ("qk", "new", (2, 3, 4, 64)),
            ("qk", "new", (2, 2, 8, 64)), ("qk", "new", (4, 2, 2, 64)), ("qk", "new", (4, 2, 4, 64)),
            ("qk", "new", (4, 2, 2, 128)), ("before", "old", (4, 2, 2, 64))]


def old_module():
    src = open(fpa.__file__).read()
    assert NEW in src
    path = "/tmp/fpa_before.py"            # a file: triton.jit reads its functions' source
    with open(path, "w") as f:
        f.write(src.replace(NEW, OLD))
    spec = importlib.util.spec_from_file_location("fpa_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv):
    shapes = [tuple(int(x) for x in a.split("x")) for a in (argv or ["1x131072", "16x8192", "1x1048576"])]
    mods = {"new": fpa, "old": old_module()}
    kerns = {k: m._triton.kernels(torch.device("cuda"))["decode"] for k, m in mods.items()}
    print("| batch x context | kernel | warps | stages | waves | keys a tile | us (first) | us (second) | "
          "max abs vs before | max abs vs reference |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    winner = None
    for b, n in shapes:
        q, ((k8, _), (v8, _)), table, lens = make(b, n)
        scale = D ** -0.5
        base, _ = mods["old"]._decode_triton(kerns["old"], q, k8, v8, table, lens, scale, None)
        ref = fpa.fp8_paged_decode_reference(q, k8, v8, table, lens, scale)[0] if b * n <= 1 << 17 else None
        times, errs = {}, {}
        for rnd in range(2):
            for i, (name, key, (w, st, wv, bn)) in enumerate(LAUNCHES):
                mod, kern = mods[key], kerns[key]
                fn = lambda: mod._decode_triton(kern, q, k8, v8, table, lens, scale, None, num_warps=w,
                                                num_stages=st, waves=wv, block_keys=bn)
                if rnd == 0:
                    out = fn()[0].float()
                    errs[i] = ((out - base.float()).abs().max().item(),
                               "-" if ref is None else f"{(out - ref.float()).abs().max().item():.2e}")
                times.setdefault(i, []).append(graph_time(fn) * 1e6)
        for i, (name, key, (w, st, wv, bn)) in enumerate(LAUNCHES):
            t, e = times[i], errs[i]
            print(f"| {b} x {n} | {name} | {w} | {st} | {wv} | {bn} | {t[0]:.1f} | {t[1]:.1f} | {e[0]:.2e} | {e[1]} |",
                  flush=True)
        winner = "qk" if min(times[1]) < min(times[0]) else "before"
        del q, k8, v8, table
        torch.cuda.empty_cache()
    with open("/tmp/decode_winner", "w") as f:
        f.write(winner)
    print(f"winner at the last shape (default launch): {winner}")


if __name__ == "__main__":
    main(sys.argv[1:])

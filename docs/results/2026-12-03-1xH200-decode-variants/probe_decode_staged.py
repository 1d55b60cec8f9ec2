"""Session probe (issue 53): the FP8 decode kernel with V and/or K times a runtime 1.0 (Triton then converts them to
fp16 once in the load's layout and stages the fp16 tile in shared memory, where fed as is it reads V's bytes one at
a time and both warps convert all of K) against the tree. us a call, CUDA graph replay, each launch timed twice in
turn; the error against the reference (small shapes) and against the tree (all shapes).
    python scripts/probe_decode_staged.py [BATCHxCONTEXT ...]
"""
import importlib.util
import os
import sys

import torch

from kernels import fp8_paged_attention as fpa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_fp8_decode import D, BS, graph_time, make  # noqa: E402

ONE = "(scale2 * 0.0 + 1.0).to(q.dtype)"        # 1.0 the compiler cannot fold (scale2 could be inf)
V_OLD = "        if MASKED:\n            v = tl.where(valid[:, None], v, 0.0)\n"
V_NEW = V_OLD + f"        else:\n            v = v * {ONE}\n"
K_OLD = "        k = k.to(tl.float8e4nv, bitcast=True).to(q.dtype)"
K_NEW = K_OLD + f" * {ONE}"
PATCHES = {"tree": [], "v staged": [(V_OLD, V_NEW)], "k staged": [(K_OLD, K_NEW)],
           "k, v staged": [(K_OLD, K_NEW), (V_OLD, V_NEW)]}
# variant, (warps, stages, waves)
LAUNCHES = [("tree", (2, 2, 4)), ("v staged", (2, 2, 4)), ("k staged", (2, 2, 4)), ("k, v staged", (2, 2, 4)),
            ("v staged", (2, 2, 5)), ("v staged", (2, 3, 4)), ("k, v staged", (2, 2, 5)), ("k, v staged", (4, 2, 2))]


def variant(name: str):
    src = open(fpa.__file__).read()
    for old, new in PATCHES[name]:
        assert old in src, name
        src = src.replace(old, new)
    path = f"/tmp/fpa_{name.replace(', ', '_').replace(' ', '_')}.py"      # a file: triton.jit reads the source
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv):
    shapes = [tuple(int(x) for x in a.split("x")) for a in (argv or ["1x131072", "16x8192", "1x1048576"])]
    mods = {name: variant(name) for name in PATCHES}
    kerns = {name: m._triton.kernels(torch.device("cuda"))["decode"] for name, m in mods.items()}
    print("| batch x context | variant | warps | stages | waves | us (first) | us (second) | max abs vs tree | "
          "max abs vs reference |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, n in shapes:
        q, ((k8, _), (v8, _)), table, lens = make(b, n)
        scale = D ** -0.5
        base, _ = fpa._decode_triton(kerns["tree"], q, k8, v8, table, lens, scale, None)
        ref = fpa.fp8_paged_decode_reference(q, k8, v8, table, lens, scale)[0] if b * n <= 1 << 17 else None
        times, errs = {}, {}
        for rnd in range(2):
            for i, (name, (w, st, wv)) in enumerate(LAUNCHES):
                mod, kern = mods[name], kerns[name]
                fn = lambda: mod._decode_triton(kern, q, k8, v8, table, lens, scale, None, num_warps=w,
                                                num_stages=st, waves=wv)
                if rnd == 0:
                    out = fn()[0].float()
                    errs[i] = ((out - base.float()).abs().max().item(),
                               "-" if ref is None else f"{(out - ref.float()).abs().max().item():.2e}")
                times.setdefault(i, []).append(graph_time(fn) * 1e6)
        for i, (name, (w, st, wv)) in enumerate(LAUNCHES):
            t, e = times[i], errs[i]
            print(f"| {b} x {n} | {name} | {w} | {st} | {wv} | {t[0]:.1f} | {t[1]:.1f} | {e[0]:.2e} | {e[1]} |",
                  flush=True)
        del q, k8, v8, table
        torch.cuda.empty_cache()
    for name, kern in kerns.items():
        try:
            facts = sorted({f"regs {c.n_regs} spills {c.n_spills} smem {c.metadata.shared}"
                            for per in kern.device_caches.values() for c in per[0].values()})
        except Exception as e:
            facts = [type(e).__name__]
        print(f"{name}: {'; '.join(facts)}")


if __name__ == "__main__":
    main(sys.argv[1:])

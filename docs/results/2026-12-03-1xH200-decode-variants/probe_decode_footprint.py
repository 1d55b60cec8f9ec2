"""Session probe (issue 53): does the FP8 decode kernel slow down over an engine-sized pool? One sequence of 1M
tokens, pages of 128, a pool of 32 layers as engine/cache/page_pool.py holds it ([layers, pages, 128, 8, 128] uint8,
one tensor for K and one for V); a CUDA graph of 32 calls, either over layer 0 each time or over the 32 layers in
turn (a decode step's order), the table in order (a prompt's pages) or shuffled. us a call (the graph / 32),
timed twice in turn. Variant "prefetch": each program asks L2 for the K/V rows AHEAD tiles ahead (one address a
tile), so that the next 2 MB page's translation is there before the loads need it.
    python scripts/probe_decode_footprint.py [CONTEXT]
"""
import importlib.util
import os
import sys

import torch

from kernels import fp8_paged_attention as fpa
from kernels.kv_quant import Fp8Pages, quantize_kv
from kernels.paged_attention import guarded_table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_fp8_decode import D, H, HKV, BS, graph_time  # noqa: E402

LAYERS = 32
LOOP_ROW = "            row = _tile_rows(table_ptr, b, g, t, table_stride, HKV, BS, BN)       # [BN]: (slot, head) rows\n"
PREFETCH = LOOP_ROW + """            ahead = tl.minimum(t + AHEAD, whole - 1)
            page_ahead = tl.load(table_ptr + b.to(tl.int64) * table_stride + ahead // tiles).to(tl.int64)
            at = ((page_ahead * BS + (ahead % tiles) * BN) * HKV + g) * D
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; prefetch.global.L2 [$2]; mov.u32 $0, 0;", "=r,l,l",
                                      [k_ptr + at, v_ptr + at], dtype=tl.int32, is_pure=False, pack=1)
"""


def variant(ahead: int):
    src = open(fpa.__file__).read()
    assert LOOP_ROW in src
    path = f"/tmp/fpa_prefetch{ahead}.py"      # a file: triton.jit reads the source
    with open(path, "w") as f:
        f.write(src.replace(LOOP_ROW, PREFETCH.replace("AHEAD", str(ahead))))
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pool(pages: int):
    """K and V pools [LAYERS, pages + 1, BS, HKV, D] uint8 and their scales; layer 0 random (an outlier channel in
    K), copied into the others."""
    out = []
    for j in range(2):
        x = torch.randn(pages + 1, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
        if j == 0:
            x[..., 3] *= 20
        data, scale = quantize_kv(x)
        del x
        big = torch.empty((LAYERS,) + data.shape, dtype=data.dtype, device="cuda")
        bigs = torch.empty((LAYERS,) + scale.shape, dtype=scale.dtype, device="cuda")
        for i in range(LAYERS):
            big[i].copy_(data)
            bigs[i].copy_(scale)
        out.append((big, bigs))
        del data, scale
    return out


def main(argv):
    context = int(argv[0]) if argv else 1 << 20
    pages = context // BS
    (k, ks), (v, vs) = pool(pages)
    layer = [(Fp8Pages(k[i], ks[i]), Fp8Pages(v[i], vs[i])) for i in range(LAYERS)]
    tables = {"in order": guarded_table(torch.arange(1, pages + 1, device="cuda", dtype=torch.int32).view(1, -1)),
              "shuffled": guarded_table((torch.randperm(pages, device="cuda") + 1).to(torch.int32).view(1, -1))}
    lens = torch.full((1,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16)
    scale = D ** -0.5
    mods = {"tree": fpa, "prefetch 8": variant(8), "prefetch 16": variant(16)}
    kerns = {name: m._triton.kernels(torch.device("cuda"))["decode"] for name, m in mods.items()}
    cases = [(name, t, order) for name in mods for t in tables for order in ("layer 0 x 32", "32 layers")]
    print(f"| context {context} | table | calls | us a call (first) | us a call (second) | max abs vs tree |")
    print("|---|---|---|---|---|---|")
    base = fpa._decode_triton(kerns["tree"], q, *layer[5], tables["in order"], lens, scale, None)[0].float()
    times, errs = {}, {}
    for rnd in range(2):
        for case in cases:
            name, t, order = case
            mod, kern, table = mods[name], kerns[name], tables[t]
            which = [0] * LAYERS if order == "layer 0 x 32" else list(range(LAYERS))

            def step():
                for i in which:
                    out = mod._decode_triton(kern, q, *layer[i], table, lens, scale, None)
                return out
            if rnd == 0:
                errs[case] = (step()[0].float() - base).abs().max().item()
            times.setdefault(case, []).append(graph_time(step) * 1e6 / LAYERS)
            if rnd == 1:
                a, b = times[case]
                print(f"| {name} | {t} | {order} | {a:.1f} | {b:.1f} | {errs[case]:.2e} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

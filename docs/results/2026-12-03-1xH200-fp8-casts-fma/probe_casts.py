"""Session probe (issue 53): FP8 attention's casts (kernels/fa3_fp8.py, q and k turned, v not) at llama3-8b's
shapes, q/k/v views of one fused qkv row as in the engine; us for the three casts, CUDA graph of 10 rounds.
Variants are source patches of kernels/fa3_fp8.py written to a temp module: head; `noround` (the turn not rounded
to bf16); `div_rn` (the division as div.rn, before; with 3 stages: the tree before); `mul` (y * (1/descale): speed
only); `onedot` (the amax pass stores the turned bf16 values, the cast pass reads them unturned); and launch settings
(values a step, programs an SM, warps, stages).
    python scripts/probe_casts.py [tokens ...]        (default 8192 131072; it ran from scripts/, copy it back there)
"""
import importlib.util
import os
import sys
import tempfile

import torch

from kernels import fa3_fp8
from kernels.arith import ceil_div, next_pow2

H, HKV, D = 32, 8, 128
SRC = open(fa3_fp8.__file__).read()
ROUND = "                y = y.to(x.dtype).to(tl.float32)         # rounded to x's dtype, as x @ turn (cuBLAS) rounds it"
DIV = "y = _divide(y, inv, shift, neg_shifted, shifted_inv)"
AMAX_SIG = "def amax_kernel(x_ptr, turn_ptr, amax_ptr, s,"
AMAX_BITS = "            bits = tl.where(ok, y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)"
STORE = ("            if ROTATE:\n"
         "                tl.store(y_ptr + r[:, None] * (tl.num_programs(1) * G * D) + head[:, None] * D + c[None, :],"
         " y.to(tl.bfloat16), mask=ok)\n")


def module(name: str, src: str):
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def variants() -> dict:
    assert ROUND in SRC and DIV in SRC and AMAX_SIG in SRC and AMAX_BITS in SRC
    onedot = SRC.replace(AMAX_SIG, "def amax_kernel(x_ptr, turn_ptr, amax_ptr, y_ptr, s,")
    onedot = onedot.replace(AMAX_BITS, STORE + AMAX_BITS)
    return {"head": module("v_head", SRC), "noround": module("v_noround", SRC.replace(ROUND, "                y = y")),
            "mul": module("v_mul", SRC.replace(DIV, "y = y * inv")), "onedot": module("v_onedot", onedot),
            "div_rn": module("v_div_rn", SRC.replace(DIV, "y = tl.div_rn(y, descale)"))}


def cast(mod, x, turn, tile=8192, pps=4, warps=None, stages=None, onedot=False, hkv=HKV):
    """mod's two kernels on x [S, Hx, D] -> (x8, descale), launched as _to_e4m3_triton with these settings."""
    kern = mod._triton.kernels(x.device) or mod._build()         # (the interpreter on CPU: a check)
    s, hx, d = x.shape
    g = hx // hkv
    gpad, dpad = next_pow2(g), next_pow2(d)
    rotate = turn is not None
    rows = max(1, tile // (gpad * dpad), ceil_div(16, gpad) if rotate else 1)
    blocks = ceil_div(s, rows)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (min(blocks, max(1, pps * sms // hkv)), hkv)
    opts = {"num_stages": mod.CAST_STAGES if stages is None else stages, **({"num_warps": warps} if warps else {})}
    launch = dict(G=g, GPAD=gpad, D=d, DPAD=dpad, ROWS=rows, INTERPRETED=x.device.type != "cuda", **opts)
    amax_bits = torch.zeros(hkv, dtype=torch.int32, device=x.device)
    descale = torch.empty(hkv, dtype=torch.float32, device=x.device)
    x8 = torch.empty(s, hx, d, dtype=fa3_fp8.FP8, device=x.device)
    t = turn if rotate else x
    if onedot:
        y = torch.empty(s, hx, d, dtype=x.dtype, device=x.device) if rotate else x
        kern["amax"][grid](x, t, amax_bits, y, s, x.stride(0), blocks, ROTATE=rotate, **launch)
        src, t, rotate = y, y, False
    else:
        kern["amax"][grid](x, t, amax_bits, s, x.stride(0), blocks, ROTATE=rotate, **launch)
        src = x
    kern["cast"][grid](src, t, amax_bits, descale, x8.view(torch.uint8), s, src.stride(0), blocks,
                       fa3_fp8.MIN_SCALE, ROTATE=rotate, **launch)
    return x8, descale


def graph_us(fn, rounds=10) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            fn()
    g.replay(); torch.cuda.synchronize()
    best = []
    for _ in range(2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            g.replay()
        b.record(); b.synchronize()
        best.append(a.elapsed_time(b) * 1e3 / (5 * rounds))
    return min(best)


def main(argv):
    lengths = [int(a) for a in argv] or [8192, 131072]
    vs = variants()
    turn = fa3_fp8.rotation(D, torch.bfloat16, torch.device("cuda"))
    launches = [("head", {}), ("div_rn", {}), ("div_rn", {"stages": 3}), ("mul", {}), ("noround", {}),
                ("onedot", {"onedot": True})]
    launches += [("head", dict(tile=t, pps=p, warps=w)) for t, p, w in (
        (8192, 4, 8), (4096, 4, 4), (4096, 8, 4), (16384, 4, 8), (8192, 2, 4), (8192, 8, 4), (4096, 4, 2))]
    print("| tokens | variant | settings | q us | k us | v us | q+k+v us | q bytes differ from head |")
    print("|---|---|---|---|---|---|---|---|")
    for n in lengths:
        qkv = torch.randn(n, H + 2 * HKV, D, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv[:, :H], qkv[:, H:H + HKV], qkv[:, H + HKV:]
        ref = fa3_fp8.to_e4m3(q, HKV, turn)[0].view(torch.uint8)
        for name, kw in launches:
            mod = vs[name]
            differ = (cast(mod, q, turn, **kw)[0].view(torch.uint8) != ref).float().mean().item()
            tq = graph_us(lambda: cast(mod, q, turn, **kw))
            tk = graph_us(lambda: cast(mod, k, turn, **kw))
            tv = graph_us(lambda: cast(mod, v, None, **kw))
            print(f"| {n} | {name} | {kw or 'default'} | {tq:.1f} | {tk:.1f} | {tv:.1f} | {tq + tk + tv:.1f} | "
                  f"{differ:.2e} |", flush=True)
        del qkv, q, k, v, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])

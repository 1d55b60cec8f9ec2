"""FP8 prefill attention over FP8 pages (kernels/fp8_attention.py) against the engine's bf16 kernel
(flash-attn-4 over bf16 pages, kernels.paged_attention) and FlashAttention-3 (the `fa3-fwd` wheel, dense
K/V, bf16 and FP8 with one descale per KV head) where it is installed: one layer with llama3-8b's
attention shapes (32 query heads, 8 KV heads, d 128, pages of 128), causal aligned to the end.

For each shape (QUERIESxKEYS): time per call (CUDA events, median of 5 after 2 warm-ups) and TFLOP/s
(4 D H x the visible (query, key) pairs), for each kernel and each launch setting of ours, with P.V in FP8
(the default) and in fp16 (`pv="fp16"`, `pv16` rows), and with V's pages transposed (`vt` rows: keys
contiguous, so the FP8 second dot reads V's tile as stored; it must equal the stored way), and the same with
Q as two e4m3 parts (`vt_qsplit` rows, launch option q_split: two FP8 dots for Q . K); the error of
ours against float64 over the cache's values (last 256 queries, the first KV head's 4 query heads, K with
an outlier channel), against its torch reference (kernels.fp8_attention.fp8_prefill_reference, the same
rounding: must agree to the dots' fp32 order), and flash-attn-4's against float64 beside them.

    python scripts/gpu_fp8_prefill.py [QUERIESxKEYS ...]     default: 8192x8192 65536x65536 65536x131072 16384x524288
    SETTINGS="128,128,8,2 128,64,4,3" python scripts/gpu_fp8_prefill.py    (block_m,block_n,warps,stages)

Prints a table; writes fp8_prefill.json under $OUT (or the working directory).
"""
import json
import os
import sys

import torch

from burstserve.kernels import fp8_attention as fa
from burstserve.kernels.kv_quant import Fp8Pages, dequantize_kv, quantize_kv
from burstserve.kernels.paged_attention import guarded_table, paged_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_gemm_shapes import timed  # noqa: E402

H, HKV, D, BS = 32, 8, 128, 128
DEFAULT_SHAPES = ["8192x8192", "65536x65536", "65536x131072", "16384x524288"]
DEFAULT_SETTINGS = "128,128,8,2 128,128,8,3 128,64,4,3 128,64,8,2 64,128,4,2 64,64,4,3"


def make(queries: int, keys: int):
    """One sequence: random K/V (an outlier channel in K) in shuffled pages, FP8 and the same values in
    bf16; q [queries, H, D] bf16."""
    pages = -(-keys // BS)
    pools = []
    for j in range(2):
        x = torch.randn(pages + 1, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
        if j == 0:
            x[..., 3] *= 20
        data, scale = quantize_kv(x)
        pools.append((Fp8Pages(data, scale), dequantize_kv(data, scale, torch.bfloat16)))
        del x
    table = guarded_table((torch.randperm(pages, device="cuda") + 1).view(1, pages).to(torch.int32))
    q = torch.randn(queries, H, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, queries], dtype=torch.int32, device="cuda")
    lens = torch.tensor([keys], dtype=torch.int32, device="cuda")
    return q, pools, table, cu, lens


def seconds(fn) -> float:
    """Median seconds of fn() over 5 calls after 2 (scripts/gpu_gemm_shapes.py's CUDA-event timing)."""
    return timed(fn, iters=5, warmup=2)


def flops(queries: int, keys: int) -> float:
    pairs = queries * (keys - queries) + queries * (queries + 1) / 2
    return 4 * D * H * pairs


def float64_rows(q, k, v, keys, rows, scale):
    """Attention in float64 of q's last `rows` queries, heads 0..3 (KV head 0), over k, v [keys, Hkv, D]."""
    qq = q[-rows:, :4].double()
    kk, vv = k[:keys, 0].double(), v[:keys, 0].double()
    s = torch.einsum("mhd,nd->hmn", qq, kk) * scale
    visible = torch.arange(keys, device=q.device)[None, :] <= torch.arange(keys - rows, keys, device=q.device)[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hmn,nd->mhd", torch.softmax(s, -1), vv)


def relative(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fa3_module():
    try:
        import fa3_fwd_interface
        return fa3_fwd_interface
    except Exception as e:       # not carried to this machine
        print(f"fa3-fwd not importable ({type(e).__name__}: {e}): its columns stay empty")
        return None


def fa3_call(f3, q, k, v, descales=None):
    kw = dict(causal=True, softmax_scale=D ** -0.5)
    if descales is not None:
        kw.update(q_descale=descales, k_descale=descales, v_descale=descales)
    res = f3.flash_attn_func(q[None], k[None], v[None], **kw)
    return res[0] if isinstance(res, tuple) else res


def run(queries: int, keys: int, settings, f3) -> dict:
    q, ((k8, kb), (v8, vb)), table, cu, lens = make(queries, keys)
    scale = D ** -0.5
    row = {"queries": queries, "keys": keys, "gflop": flops(queries, keys) / 1e9}

    # V's pages transposed, [blocks, KV heads, D, page] (keys contiguous): the FP8 second dot reads V's tile
    # K-major as stored, without the byte-wise transpose in shared memory (scripts/hopper_codegen.py prefill-vt)
    v8t = v8._replace(data=v8.data.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2))

    def ours(s, pv="fp8", v_pages=v8, q_split=False):
        bm, bn, w, st = s
        return fa.fp8_prefill(q, k8, v_pages, table, cu, lens, scale, True, queries, block_m=bm, block_n=bn,
                              num_warps=w, num_stages=st, pv=pv, q_split=q_split)

    # accuracy: ours (default setting) and flash-attn-4 against float64 over the same (rounded) values
    pages = table[0, :-(-keys // BS)].long()
    k_flat, v_flat = kb[pages].flatten(0, 1), vb[pages].flatten(0, 1)
    want = float64_rows(q, k_flat, v_flat, keys, 256, scale)
    out, lse = ours(settings[0])
    row["err_ours"] = relative(out[-256:, :4], want)
    row["vt_vs_ours"] = relative(ours(settings[0], v_pages=v8t)[0], out)      # the same arithmetic
    row["err_ours_qsplit"] = relative(ours(settings[0], v_pages=v8t, q_split=True)[0][-256:, :4], want)
    out16, lse16 = ours(settings[0], "fp16")
    row["err_ours_pv16"] = relative(out16[-256:, :4], want)
    bf16, _ = paged_attention(q, kb, vb, table, cu, lens, scale, causal=True, backend="fa4", max_seqlen_q=queries)
    row["err_fa4_bf16"] = relative(bf16[-256:, :4], want)
    if queries * keys <= 8192 * 8192:
        ref, ref_lse = fa.fp8_prefill_reference(q, k8, v8, table, cu, lens, scale, True, block_n=settings[0][1])
        row["vs_reference"] = relative(out, ref)
        row["lse_vs_reference"] = (lse - ref_lse).abs().max().item()
        ref16, _ = fa.fp8_prefill_reference(q, k8, v8, table, cu, lens, scale, True, block_n=settings[0][1], pv="fp16")
        row["pv16_vs_reference"] = relative(out16, ref16)
    del bf16, out, lse, out16, lse16
    torch.cuda.empty_cache()

    row["fa4_bf16_s"] = seconds(lambda: paged_attention(q, kb, vb, table, cu, lens, scale, causal=True, backend="fa4",
                                                        max_seqlen_q=queries))
    for s in settings:
        try:
            row[f"ours_{'_'.join(map(str, s))}_s"] = seconds(lambda: ours(s))
        except Exception as e:
            row[f"ours_{'_'.join(map(str, s))}_s"] = None
            print(f"  setting {s}: {type(e).__name__}: {str(e)[:200]}")
    for s in settings:
        try:
            row[f"ours_pv16_{'_'.join(map(str, s))}_s"] = seconds(lambda: ours(s, "fp16"))
        except Exception as e:
            row[f"ours_pv16_{'_'.join(map(str, s))}_s"] = None
            print(f"  setting {s}, pv fp16: {type(e).__name__}: {str(e)[:200]}")
    for s in settings:
        try:
            row[f"ours_vt_{'_'.join(map(str, s))}_s"] = seconds(lambda: ours(s, v_pages=v8t))
        except Exception as e:
            row[f"ours_vt_{'_'.join(map(str, s))}_s"] = None
            print(f"  setting {s}, V transposed: {type(e).__name__}: {str(e)[:200]}")
    for s in settings:
        try:
            row[f"ours_vt_qsplit_{'_'.join(map(str, s))}_s"] = seconds(lambda: ours(s, v_pages=v8t, q_split=True))
        except Exception as e:
            row[f"ours_vt_qsplit_{'_'.join(map(str, s))}_s"] = None
            print(f"  setting {s}, V transposed, Q split: {type(e).__name__}: {str(e)[:200]}")
    row["ours_fp16_dots_s"] = seconds(lambda: fa.fp8_prefill(q, k8, v8, table, cu, lens, scale, True, queries,
                                                             dots="fp16"))
    if f3 is not None and queries == keys:          # dense K/V: the prompt's own keys
        kd, vd = k_flat[:keys], v_flat[:keys]
        row["fa3_bf16_s"] = seconds(lambda: fa3_call(f3, q, kd, vd))
        q8, k8d, v8d = (t.to(torch.float8_e4m3fn) for t in (q, kd, vd))
        one = torch.ones(1, HKV, device="cuda", dtype=torch.float32)
        row["fa3_fp8_s"] = seconds(lambda: fa3_call(f3, q8, k8d, v8d, one))
    return row


def main(argv):
    shapes = argv or DEFAULT_SHAPES
    settings = [tuple(int(x) for x in s.split(",")) for s in os.environ.get("SETTINGS", DEFAULT_SETTINGS).split()]
    f3 = fa3_module()
    print(f"GPU: {torch.cuda.get_device_name(0)}; settings (block_m, block_n, warps, stages): {settings}")
    rows = []
    for shape in shapes:
        m, n = (int(x) for x in shape.split("x"))
        rows.append(run(m, n, settings, f3))
        r = rows[-1]
        timed = {k: v for k, v in r.items() if k.endswith("_s") and v}
        best = min((v, k) for k, v in timed.items() if k.startswith("ours_") and "fp16" not in k)
        print(f"\n{m} x {n}: {r['gflop']:.0f} GFLOP; error vs float64: ours {r['err_ours']:.4f} "
              f"(pv fp16: {r['err_ours_pv16']:.4f}), flash-attn-4 bf16 {r['err_fa4_bf16']:.4f}; "
              f"V transposed vs stored {r['vt_vs_ours']:.1e}; Q split (vt_qsplit) {r['err_ours_qsplit']:.4f}"
              + (f"; ours vs its reference {r['vs_reference']:.2e} (lse {r['lse_vs_reference']:.1e}, pv fp16 "
                 f"{r['pv16_vs_reference']:.2e})" if "vs_reference" in r else ""))
        print("| kernel | ms | TFLOP/s |\n|---|---|---|")
        for k, v in timed.items():
            print(f"| {k[:-2]}{' (best)' if k == best[1] else ''} | {v * 1e3:.2f} | {r['gflop'] / v / 1e3:.0f} |")
        torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "fp8_prefill.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

"""FP8 paged decode (kernels/fp8_paged_attention.py) against flash-attn-4's bf16 paged decode (the engine's
decode kernel), one layer with llama3-8b's attention shapes (32 query heads, 8 KV heads, d 128, pages of
128): its error against fp32 attention over the same rounded K/V, and each kernel's time per call replayed
in a CUDA graph, with the KV bytes it reads per second.

    python scripts/gpu_fp8_decode.py [BATCHxCONTEXT ...]      default: 1x131072 16x8192 64x2048 1x1048576

Prints a table; writes fp8_decode.json under $OUT (or the working directory).
"""
import json
import os
import sys

import torch

from burstserve.kernels.fp8_paged_attention import choose_splits, fp8_paged_decode, fp8_paged_decode_reference
from burstserve.kernels.kv_quant import SCALE_BYTES, Fp8Pages, dequantize_kv, quantize_kv
from burstserve.kernels.paged_attention import guarded_table, paged_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernel_timing import graph_us  # noqa: E402

H, HKV, D, BS = 32, 8, 128, 128


def make(batch: int, context: int):
    """Random K/V (an outlier channel in K) in shuffled pages, FP8 and the same values in bf16."""
    pages = context // BS
    blocks = batch * pages + 1
    pools = []
    for j in range(2):
        x = torch.randn(blocks, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
        if j == 0:
            x[..., 3] *= 20
        data, scale = quantize_kv(x)
        pools.append((Fp8Pages(data, scale), dequantize_kv(data, scale, torch.bfloat16)))
        del x
    order = torch.randperm(blocks - 1, device="cuda") + 1
    table = guarded_table(order[:batch * pages].view(batch, pages).to(torch.int32))
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    return q, pools, table, lens


def graph_time(fn) -> float:
    """Seconds per call of fn replayed in a CUDA graph (scripts/gpu_kernel_timing.py's graph_us)."""
    return graph_us(fn)[0] / 1e6


def run(batch: int, context: int) -> dict:
    q, ((k8, kb), (v8, vb)), table, lens = make(batch, context)
    scale = D ** -0.5
    row = {"batch": batch, "context": context,
           "splits": choose_splits(batch, HKV, table.shape[1] * BS,
                                   torch.cuda.get_device_properties(0).multi_processor_count)}
    out, lse = fp8_paged_decode(q, k8, v8, table, lens, scale)
    if batch * context <= 1 << 18:
        ref, ref_lse = fp8_paged_decode_reference(q, k8, v8, table, lens, scale)
        row["max_abs_err_vs_fp32"] = (out.float() - ref.float()).abs().max().item()
        row["rel_err_vs_fp32"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        row["lse_err"] = (lse - ref_lse).abs().max().item()
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    fa4_out, _ = paged_attention(q, kb, vb, table, cu, lens, scale, causal=False, max_seqlen_q=1)
    row["fp8_vs_fa4_bf16_max_abs"] = (out.float() - fa4_out.float()).abs().max().item()
    tokens = batch * context
    row["fp8_us"] = graph_time(lambda: fp8_paged_decode(q, k8, v8, table, lens, scale)) * 1e6
    row["fp8_TBps"] = tokens * HKV * 2 * (D + SCALE_BYTES) / (row["fp8_us"] * 1e-6) / 1e12
    try:
        row["fa4_us"] = graph_time(lambda: paged_attention(q, kb, vb, table, cu, lens, scale, causal=False,
                                                           max_seqlen_q=1)) * 1e6
        row["fa4_TBps"] = tokens * HKV * 2 * D * 2 / (row["fa4_us"] * 1e-6) / 1e12
    except Exception as e:        # no flash-attn-4: the table says so
        row["fa4_us"] = f"{type(e).__name__}: {e}"[:80]
    return row


def main(argv: list[str]) -> None:
    shapes = [tuple(int(x) for x in a.split("x")) for a in (argv or ["1x131072", "16x8192", "64x2048", "1x1048576"])]
    rows = []
    print("| batch x context | splits | fp8 us | fp8 TB/s | fa4 bf16 us | fa4 TB/s | speed-up | max abs err vs fp32 "
          "| rel err | fp8 vs fa4 max abs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b, n in shapes:
        try:
            r = run(b, n)
        except torch.cuda.OutOfMemoryError:
            r = {"batch": b, "context": n, "error": "OOM"}
        rows.append(r)
        torch.cuda.empty_cache()
        f = lambda k, fmt="{:.1f}": fmt.format(r[k]) if isinstance(r.get(k), float) else str(r.get(k, "-"))  # noqa: E731
        speed = (f"{r['fa4_us'] / r['fp8_us']:.2f}x" if isinstance(r.get("fa4_us"), float) and "fp8_us" in r else "-")
        print(f"| {b} x {n} | {r.get('splits', '-')} | {f('fp8_us')} | {f('fp8_TBps', '{:.2f}')} | {f('fa4_us')} | "
              f"{f('fa4_TBps', '{:.2f}')} | {speed} | {f('max_abs_err_vs_fp32', '{:.2e}')} | "
              f"{f('rel_err_vs_fp32', '{:.2e}')} | {f('fp8_vs_fa4_bf16_max_abs', '{:.2e}')} |", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_decode.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

"""FlashAttention-3's FP8 forward as `--attention-backend fa3-fp8` (kernels/fa3_fp8.py) on one GPU, llama3-8b's
attention shapes (32 query heads, 8 KV heads, d 128): its error against float64 as the keys grow (Hopper's
FP8 accumulation drifts with a call's length: segments bound it), its speed against flash-attn-4 in bf16, and
the kernel against the torch path of the same arithmetic.

    python scripts/gpu_fa3_fp8.py [error] [speed] [agree]        (default: all three)
    KEYS=8192,131072,1048576 SEGMENTS=16384,32768 SPEED_LENGTHS=8192,131072 python scripts/gpu_fa3_fp8.py

error: the last 256 queries of a prompt of N keys (they see every key), KV head 0's four query heads, against
    float64; K/V bf16 random, "plain" (diffuse attention) and "sink" (key 0 takes about half of every row's
    weight, as trained models' first token does); FA3 FP8 in one call and in segments, flash-attn-4 bf16.
speed: a causal square of S tokens, one layer: flash-attn-4 bf16, FA3 bf16, fa3_fp8_attention (its casts
    included) in one call and in segments, FA3's FP8 kernel alone on operands cast before, the casts of q, k, v
    (q and k turned) alone (the Triton kernels, and the torch path's ops); ms and TFLOP/s (CUDA events, median of
    5 after 2).
agree: the kernel against the torch path on the same operands (2K causal, 4K keys end-aligned): the
    difference must be far below either's error against float64.
Prints tables; writes fa3_fp8.json under $OUT (or the working directory).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from burstserve.kernels.attention import fa4_forward  # noqa: E402
from burstserve.kernels.fa3_fp8 import _fa3_module, _to_e4m3_torch, fa3_fp8_attention, rotation, to_e4m3  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernel_timing import timed  # noqa: E402  (CUDA events, median after warm-ups: seconds)


def timed_ms(fn) -> float:
    return timed(fn, iters=5, warmup=2) * 1e3

H, HKV, D = 32, 8, 128
SCALE = D ** -0.5
ROWS = 256


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_kv(keys: int, kind: str, gen: torch.Generator):
    """q [ROWS, H, D], k, v [keys, Hkv, D] bf16; "sink": key 0 along q's shared direction."""
    q = torch.randn(ROWS, H, D, device="cuda", generator=gen)
    k = torch.randn(keys, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(keys, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    if kind == "sink":
        u = torch.randn(D, device="cuda", generator=gen)
        u = u / u.norm()
        q = q + 3.0 * u
        # q . k0 * SCALE ~ log(keys) + 0.5: about as much weight as all the other keys together
        k[0] = (u * (D ** 0.5) * (torch.log(torch.tensor(float(keys))) + 0.5) / 3.0).to(torch.bfloat16)
    return q.to(torch.bfloat16), k, v


def float64_rows(q, k, v, chunk: int = 65536) -> torch.Tensor:
    """softmax(q k^T * SCALE) v in float64 for query heads 0..3 (KV head 0), keys in chunks -> [ROWS, 4, D]."""
    qq = q[:, :4].double()
    m = torch.full((4, ROWS, 1), float("-inf"), dtype=torch.float64, device="cuda")
    s_acc = torch.zeros(4, ROWS, 1, dtype=torch.float64, device="cuda")
    o_acc = torch.zeros(4, ROWS, D, dtype=torch.float64, device="cuda")
    for a in range(0, k.shape[0], chunk):
        kk, vv = k[a:a + chunk, 0].double(), v[a:a + chunk, 0].double()
        s = torch.einsum("mhd,nd->hmn", qq, kk) * SCALE                                  # [4, ROWS, c]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        w = torch.exp(m - m_new)
        p = torch.exp(s - m_new)
        s_acc = s_acc * w + p.sum(-1, keepdim=True)
        o_acc = o_acc * w + torch.einsum("hmn,nd->hmd", p, vv)
        m = m_new
    return (o_acc / s_acc).transpose(0, 1)                                              # [ROWS, 4, D]


def error_part(keys_list, segments_list) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for kind in ("plain", "sink"):
        for keys in keys_list:
            q, k, v = make_kv(keys, kind, gen)
            want = float64_rows(q, k, v)
            row = {"kind": kind, "keys": keys}
            out, _ = fa4_forward(q[None], k[None], v[None], softmax_scale=SCALE, causal=False)
            row["fa4_bf16"] = relative(out[0][:, :4], want)
            row["fa3_fp8_one_call"] = relative(
                fa3_fp8_attention(q, k, v, False, SCALE, segment=1 << 30, kernel="fa3")[0][:, :4], want)
            for seg in segments_list:
                row[f"fa3_fp8_seg{seg}"] = relative(
                    fa3_fp8_attention(q, k, v, False, SCALE, segment=seg, kernel="fa3")[0][:, :4], want)
            if keys <= 32768:
                row["torch_path"] = relative(fa3_fp8_attention(q, k, v, False, SCALE, kernel="torch")[0][:, :4], want)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, k, v, out, want
            torch.cuda.empty_cache()
    return rows


def speed_part(lengths, segments_list) -> list[dict]:
    rows = []
    f3 = _fa3_module()
    gen = torch.Generator(device="cuda").manual_seed(1)
    for s in lengths:
        q = torch.randn(s, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        k = torch.randn(s, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = torch.randn(s, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        flop = 4 * D * H * s * (s + 1) / 2
        row = {"tokens": s}
        row["fa4_bf16_ms"] = timed_ms(lambda: fa4_forward(q[None], k[None], v[None], softmax_scale=SCALE, causal=True))
        row["fa3_bf16_ms"] = timed_ms(lambda: f3.flash_attn_func(q[None], k[None], v[None], softmax_scale=SCALE,
                                                                  causal=True))
        row["fa3_fp8_one_call_ms"] = timed_ms(lambda: fa3_fp8_attention(q, k, v, True, SCALE, segment=1 << 30))
        turn = rotation(D, q.dtype, q.device)                      # as fa3_fp8_attention turns q and k
        (q8, qd), (k8, kd), (v8, vd) = to_e4m3(q, HKV, turn), to_e4m3(k, HKV, turn), to_e4m3(v, HKV)
        row["fa3_fp8_kernel_alone_ms"] = timed_ms(lambda: f3.flash_attn_func(
            q8[None], k8[None], v8[None], softmax_scale=SCALE, causal=True, q_descale=qd[None], k_descale=kd[None],
            v_descale=vd[None]))
        row["casts_ms"] = timed_ms(lambda: [to_e4m3(q, HKV, turn), to_e4m3(k, HKV, turn), to_e4m3(v, HKV)])
        row["casts_torch_ops_ms"] = timed_ms(lambda: [_to_e4m3_torch(q, HKV, turn), _to_e4m3_torch(k, HKV, turn),
                                                      _to_e4m3_torch(v, HKV)])
        del q8, k8, v8
        for seg in segments_list:
            row[f"fa3_fp8_seg{seg}_ms"] = timed_ms(lambda: fa3_fp8_attention(q, k, v, True, SCALE, segment=seg))
        row = {key: (round(val, 3) if isinstance(val, float) else val) for key, val in row.items()}
        row["tflops"] = {key[:-3]: round(flop / (val * 1e-3) / 1e12) for key, val in row.items() if key.endswith("_ms")}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def agree_part() -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    for sq, sk in ((2048, 2048), (1024, 4096)):
        q = torch.randn(sq, H, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        k = torch.randn(sk, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        v = torch.randn(sk, HKV, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        kern, kern_lse = fa3_fp8_attention(q, k, v, True, SCALE, kernel="fa3")
        ref, ref_lse = fa3_fp8_attention(q, k, v, True, SCALE, kernel="torch")
        exact = torch.nn.functional.scaled_dot_product_attention(
            q.double().transpose(0, 1), k.double().repeat_interleave(H // HKV, 1).transpose(0, 1),
            v.double().repeat_interleave(H // HKV, 1).transpose(0, 1), is_causal=False,
            attn_mask=(torch.arange(sk, device="cuda")[None] <= torch.arange(sk - sq, sk, device="cuda")[:, None]),
            scale=SCALE).transpose(0, 1)
        row = {"queries": sq, "keys": sk, "kernel_vs_torch": relative(kern, ref),
               "lse_max_diff": (kern_lse - ref_lse).abs().max().item(),
               "kernel_vs_float64": relative(kern, exact), "torch_vs_float64": relative(ref, exact)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(parts) -> None:
    parts = parts or ["agree", "error", "speed"]
    keys_list = [int(x) for x in os.environ.get("KEYS", "8192,32768,131072,524288,1048576").split(",")]
    segments_list = [int(x) for x in os.environ.get("SEGMENTS", "32768,65536").split(",")]
    lengths = [int(x) for x in os.environ.get("SPEED_LENGTHS", "8192,16384,32768,131072").split(",")]
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    result = {"gpu": torch.cuda.get_device_name(0)}
    with torch.inference_mode():
        if "agree" in parts:
            result["agree"] = agree_part()
        if "error" in parts:
            result["error"] = error_part(keys_list, segments_list)
        if "speed" in parts:
            result["speed"] = speed_part(lengths, segments_list)
    with open(os.path.join(os.environ.get("OUT", "."), "fa3_fp8.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    for name in ("error", "speed"):
        if result.get(name):
            cols = [c for c in result[name][0] if c != "tflops"]
            print(f"\n| {' | '.join(cols)} |\n|{'---|' * len(cols)}")
            for r in result[name]:
                print("| " + " | ".join(f"{r[c]:.4f}" if isinstance(r.get(c), float) and c != "tokens" and
                                        not c.endswith("_ms") else str(r.get(c, "-")) for c in cols) + " |")
            if name == "speed":
                for r in result[name]:
                    print(r["tokens"], "TFLOP/s", r["tflops"])


if __name__ == "__main__":
    main(sys.argv[1:])

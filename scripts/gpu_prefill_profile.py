"""Where a prefill's time goes on one GPU (llama3-8b preset, bf16, burst on one worker), against the
floor arithmetic of issue 13: per prompt length, the wall time of ModelRunner.prefill, the GPU time by
kind of kernel under torch.profiler (attention, GEMMs, fused Triton kernels, other elementwise, copies),
the host's share (wall minus GPU busy), each kind's FLOP rate, and what a new prompt length costs the
first time. Usage: python scripts/gpu_prefill_profile.py [lengths, comma-separated]  (markdown tables)"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine.config import EngineConfig, resolve_model
from engine.model_runner import ModelRunner

LENGTHS = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8192,32768,131072").split(",")]
GEMM_TFLOPS, ATTENTION_TFLOPS = 783.0, 644.0     # issue 13's kernel rates on one H200 (bf16 GEMM, causal attention)
KINDS = ("attention", "gemm", "triton", "elementwise", "copy", "nccl")


def kind_of(name: str) -> str:
    low = name.lower()
    if "flash" in low or "fmha" in low or "attention" in low:
        return "attention"
    if "nccl" in low:
        return "nccl"
    if "memcpy" in low or "memset" in low:
        return "copy"
    if "gemm" in low or "nvjet" in low or "xmma" in low or "cutlass" in low or "matmul" in low:
        return "gemm"
    if low.startswith(("rms_norm_kernel", "rope_kernel", "silu_and_mul_kernel", "store_kv_kernel",
                       "quantize_fp8_kernel", "merge_kernel", "_prep_kernel", "_merge_kernel")):   # kernels/ Triton
        return "triton"
    return "elementwise"


def flops(cfg, n: int) -> tuple[float, float]:
    """(linear FLOPs, causal attention FLOPs) of a prefill of n tokens: the LM head for one row."""
    d, hkv_d, ffn = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    per_token = d * d * 2 + d * hkv_d * 2 + 3 * d * ffn                    # q, o; k, v; gate, up, down
    linear = 2.0 * n * per_token * cfg.num_layers + 2.0 * d * cfg.vocab_size
    attention = 2.0 * n * n * cfg.num_heads * cfg.head_dim * cfg.num_layers   # QK and PV, half the square each
    return linear, attention


def by_kind(prof) -> tuple[dict[str, float], int, list[tuple[str, float]]]:
    """GPU ms by kind, kernel count, and the top kernels by GPU ms."""
    ms = dict.fromkeys(KINDS, 0.0)
    names: dict[str, float] = {}
    count = 0
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        count += 1
        t = e.device_time / 1e3
        ms[kind_of(e.name)] += t
        names[e.name[:90]] = names.get(e.name[:90], 0.0) + t
    return ms, count, sorted(names.items(), key=lambda kv: -kv[1])[:12]


engine = EngineConfig(model="llama3-8b", devices=["cuda:0"], dtype="bfloat16", max_num_seqs=4)
cfg, max_model_len = resolve_model(engine)
dev = torch.device("cuda:0")
runner = ModelRunner(engine, cfg, 0, dev, None, max_model_len)
print(f"attention backend: {runner.backend.name}; GPU {torch.cuda.get_device_name(0)}\n")
prompt = torch.randint(0, cfg.vocab_size, (max(LENGTHS),))
seq = iter(range(1, 1 << 20))


def prefill(n: int) -> float:
    s = next(seq)
    wall0 = time.perf_counter()
    runner.prefill(s, prompt[:n])
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall0
    runner.free([s])
    return wall


rows, firsts, tops = [], [], {}
for n in LENGTHS:
    prefill(n)                                   # warm this length
    walls = [prefill(n) for _ in range(3)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        profiled = prefill(n)
    ms, count, top = by_kind(prof)
    linear, attention = flops(cfg, n)
    rows.append((n, min(walls), sum(walls) / 3, profiled, ms, count, linear, attention))
    tops[n] = top
    new = n - 64                                 # a length never seen: its first call against its second
    firsts.append((new, prefill(new), prefill(new)))

print("## prefill on one GPU: wall time against GPU time by kind (ms) and the floor\n")
print("| tokens | wall mean (min) | GPU busy | attention | GEMM | Triton fused | other elementwise | copies | host gap | kernels | floor (GEMM 783, attn 644 TF/s) | floor / wall |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for n, lo, mean, profiled, ms, count, linear, attention in rows:
    busy = sum(ms.values())
    floor = linear / GEMM_TFLOPS / 1e9 + attention / ATTENTION_TFLOPS / 1e9    # ms
    print(f"| {n} | {mean * 1e3:.1f} ({lo * 1e3:.1f}) | {busy:.1f} | {ms['attention']:.1f} | {ms['gemm']:.1f} | "
          f"{ms['triton']:.1f} | {ms['elementwise']:.1f} | {ms['copy']:.1f} | {profiled * 1e3 - busy:.1f} | {count} | "
          f"{floor:.1f} | {floor / (mean * 1e3):.0%} |")
print("\n## rates: FLOPs over each kind's GPU time (TFLOP/s)\n")
print("| tokens | linear TFLOP | GEMM TFLOP/s | attention TFLOP | attention TFLOP/s |\n|---|---|---|---|---|")
for n, lo, mean, profiled, ms, count, linear, attention in rows:
    print(f"| {n} | {linear / 1e12:.1f} | {linear / ms['gemm'] / 1e9:.0f} | {attention / 1e12:.1f} | "
          f"{attention / ms['attention'] / 1e9:.0f} |")
print("\n## a new prompt length: its first prefill against its second (s)\n")
print("| tokens | first | second | first - second |\n|---|---|---|---|")
for new, first, second in firsts:
    print(f"| {new} | {first:.3f} | {second:.3f} | {first - second:.3f} |")
for n, top in tops.items():
    print(f"\n## top kernels at {n} tokens (GPU ms)\n\n| kernel | ms | kind |\n|---|---|---|")
    for name, t in top:
        print(f"| {name.replace('|', '/')} | {t:.2f} | {kind_of(name)} |")

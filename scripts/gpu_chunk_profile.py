"""Where a chunk's time goes late in a long prompt, on one GPU (llama3-8b preset, bf16): the cost of an
incremental prefill (ModelRunner.extend) of n tokens after ~C cached ones against the same tokens' share
of an unchunked prefill, the paged attention call over the cached part alone (as it is, and with the
keys split k ways as a batch of k sequences of the same queries), and one extend under torch.profiler.
Usage: python scripts/gpu_chunk_profile.py [context]   (prints markdown tables)"""
import sys
import time

import torch
from profile_table import kernel_table

from burstserve.engine.config import EngineConfig, resolve_model
from burstserve.engine.model_runner import ModelRunner
from burstserve.engine.worker import runner_alone
from burstserve.engine.calls import Extend, Prefill
from burstserve.kernels.paged_attention import _fa4_call, guarded_table, paged_attention

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
dev = torch.device("cuda:0")


def timed(fn, repeats=5):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


# ---- 1. the paged call over the cached keys alone: as it is, and split k ways
h, hkv, d, bs = 32, 8, 128, 128
pages = ctx // bs
k_cache = torch.randn(pages + 1, bs, hkv, d, device=dev, dtype=torch.bfloat16)
v_cache = torch.randn_like(k_cache)
table = guarded_table(torch.arange(1, pages + 1, device=dev, dtype=torch.int32)[None])
print(f"## paged attention, non-causal, {ctx} cached keys, H {h} Hkv {hkv} D {d}\n")
print("| queries | splits | ms | TFLOP/s |\n|---|---|---|---|")
for m in (256, 512):
    q = torch.randn(m, h, d, device=dev, dtype=torch.bfloat16)
    flop = 4 * m * ctx * h * d
    cu = torch.tensor([0, m], device=dev, dtype=torch.int32)
    lens = torch.tensor([ctx], device=dev, dtype=torch.int32)
    t = timed(lambda: paged_attention(q, k_cache, v_cache, table, cu, lens, 0.088, causal=False, num_chunks=1))
    print(f"| {m} | 1 (num_chunks=1) | {t * 1e3:.2f} | {flop / t / 1e12:.0f} |")
    for k in (2, 4):
        per = pages // k
        starts = [j * per for j in range(k)]
        widths = [per] * (k - 1) + [pages - per * (k - 1)]
        rows = torch.zeros(k, max(widths), dtype=torch.int32, device=dev)
        for j in range(k):
            rows[j, :widths[j]] = torch.arange(1 + starts[j], 1 + starts[j] + widths[j], device=dev)
        rows = guarded_table(rows)
        cu_k = torch.arange(0, (k + 1) * m, m, device=dev, dtype=torch.int32)
        used = torch.tensor([w * bs for w in widths], device=dev, dtype=torch.int32)

        def split():
            qr = q.repeat(k, 1, 1)
            out, lse = _fa4_call(qr, k_cache, v_cache, rows, cu_k, used, 0.088, False, m)
            lse = lse.view(k, m, h)
            w = torch.softmax(lse, dim=0)
            return (out.view(k, m, h, d).float() * w[..., None]).sum(0).to(q.dtype)
        t = timed(split)
        print(f"| {m} | {k} | {t * 1e3:.2f} | {flop / t / 1e12:.0f} |")
del k_cache, v_cache
torch.cuda.empty_cache()

# ---- 2. extend calls late in a long prompt, against the prompt's unchunked prefill
engine = EngineConfig(model="llama3-8b", devices=["cuda:0"], dtype="bfloat16", max_num_seqs=16)
cfg, max_model_len = resolve_model(engine)
runner = ModelRunner(engine, cfg, 0, dev, None, max_model_len)
kv = runner_alone(runner)                       # places each call, then runs it here
prompt = torch.randint(0, 250, (ctx + 32768,))
kv.call(Prefill(9, prompt[:8192]))
whole = kv.call(Prefill(1, prompt[:ctx])).prefill_seconds
print(f"\n## extend calls (unchunked prefill of {ctx}: {whole:.3f} s)\n")
print("| new tokens | context | wall ms | ms per 1K tokens |\n|---|---|---|---|")
done = 0
for stop in (16384, 65536, ctx - 16384):
    while done < stop:
        if done == 0:
            kv.call(Prefill(2, prompt[:8192]))
        else:
            kv.call(Extend(2, prompt[done:done + 8192], done))
        done += 8192
    for n in (256, 512, 1024):
        kv.call(Extend(2, prompt[done:done + n], done))          # warm this shape
        done += n
        t0 = time.perf_counter()
        kv.call(Extend(2, prompt[done:done + n], done))
        wall = time.perf_counter() - t0
        print(f"| {n} | {done} | {wall * 1e3:.1f} | {wall * 1e3 / n * 1024:.1f} |")
        done += n

# ---- 3. one 256-token extend under the profiler: GPU busy against wall, kernels by GPU time, host ops
from torch.profiler import ProfilerActivity, profile

n = 256
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    t0 = time.perf_counter()
    kv.call(Extend(2, prompt[done:done + n], done))
    wall = time.perf_counter() - t0
busy, kernels, table = kernel_table(prof, top=12)
print(f"\n## one extend of {n} after {done}: wall {wall * 1e3:.1f} ms, GPU busy {busy:.1f} ms, kernels {kernels}\n")
print(table)
print("\n## host: operators by self CPU time\n")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))

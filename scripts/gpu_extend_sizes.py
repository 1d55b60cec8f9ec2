"""A chunk's extend time by size late in a long prompt, one GPU (llama3-8b preset, bf16): the extend CUDA
graphs of 256..1024 new tokens after ~C cached, with the cached keys cut into the runs the engine picks
(kernels.paged_attention.runs_filling_waves). Per size: the runs, the mean of 5 extends (each truncated back
after), attention TFLOP/s of the whole call. Usage: python scripts/gpu_extend_sizes.py [context]   (a markdown
table; `bash scripts/gpu.sh extend` runs it)"""
import sys
import time

import torch

from burstserve.engine.config import EngineConfig, resolve_model
from burstserve.engine.model_runner import ModelRunner
from burstserve.engine.worker import runner_alone
from burstserve.engine.calls import Extend, Prefill, Truncate

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 122880
chunk = 8192
engine = EngineConfig(model="llama3-8b", devices=["cuda:0"], dtype="bfloat16", max_num_seqs=16,
                      max_num_batched_tokens=chunk, mixed_batch=False)
cfg, max_model_len = resolve_model(engine)
runner = ModelRunner(engine, cfg, 0, torch.device("cuda:0"), None, ctx + 4096)
kv = runner_alone(runner)                       # places each call, then runs it here
prompt = torch.randint(0, 250, (ctx + 2048,), generator=torch.Generator().manual_seed(0))
kv.call(Prefill(0, prompt[:chunk]))
for start in range(chunk, ctx, chunk):
    kv.call(Extend(0, prompt[start:min(start + chunk, ctx)], start))
print(f"runs as the engine picks them, {ctx} cached, {torch.cuda.get_device_name(0)}\n")
print("| new tokens | runs | extend ms (mean of 5) | graphed | attention TFLOP/s (whole call) |\n|---|---|---|---|---|")
for m in range(256, 1025, 128):
    times, graphed = [], None
    for i in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = kv.call(Extend(0, prompt[ctx:ctx + m], ctx))
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
        graphed = result.graphed
        kv.call(Truncate(0, ctx, kv.ledger.truncate(0, ctx)))
    ms = sum(times) / len(times) * 1e3
    flop = 4.0 * m * (ctx + m / 2) * cfg.num_heads * cfg.head_dim * cfg.num_layers
    runs = runner.extend_graphs.runs.get(m) if runner.extend_graphs else None
    print(f"| {m} | {runs} | {ms:.2f} | {graphed} | {flop / (ms / 1e3) / 1e12:.0f} |")

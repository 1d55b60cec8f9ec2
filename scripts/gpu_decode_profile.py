"""Where a decode step's time goes on one GPU (llama3-8b preset, bf16, one 8K-token sequence):
the whole step as the scheduler calls it (ModelRunner.decode), the CUDA graph's replay alone, and
the replay's kernels by GPU time (torch.profiler). Usage: [MODEL=preset] [LAYERS=N] [CHUNK=N] [KV=fp8] [QUANT=fp8] python scripts/gpu_decode_profile.py [context]
(LAYERS=N keeps the preset's first N layers: a proxy of a model larger than one GPU.)"""
import dataclasses
import os
import sys
import time

import torch
from profile_table import kernel_table

from engine.config import EngineConfig, resolve_model
from engine.model_runner import ModelRunner
from engine.calls import Decode, Extend, Prefill

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
CHUNK = int(os.environ.get("CHUNK", "0"))       # > 0: prefill in chunks of CHUNK (the pool sized for them): 512K fits
engine = EngineConfig(model=os.environ.get("MODEL", "llama3-8b"), devices=["cuda:0"], dtype="bfloat16", max_num_seqs=16,
                      max_num_batched_tokens=CHUNK or None, kv_cache_dtype=os.environ.get("KV", "auto"),
                      quantization=os.environ.get("QUANT", "none"))
cfg, max_model_len = resolve_model(engine)
if int(os.environ.get("LAYERS", "0")):
    cfg = dataclasses.replace(cfg, num_layers=int(os.environ["LAYERS"]))
    max_model_len = min(max_model_len, ctx + 1024)
runner = ModelRunner(engine, cfg, 0, torch.device("cuda:0"), None, max_model_len)
prompt = torch.randint(0, 250, (ctx,))
if CHUNK:
    runner.prefill(Prefill(0, prompt[:CHUNK]))
    for start in range(CHUNK, ctx, CHUNK):
        runner.extend(Extend(0, prompt[start:start + CHUNK], start))
else:
    runner.prefill(Prefill(0, prompt))
tok, pos = 5, ctx


def step():
    global tok, pos
    greedy = runner.decode(Decode([0], [tok], [pos])).tokens
    tok, pos = greedy[0], pos + 1


for _ in range(5):
    step()
torch.cuda.synchronize()
n = 100
t0 = time.perf_counter()
for _ in range(n):
    step()
step_ms = (time.perf_counter() - t0) * 1000 / n
graph = runner.graphs.graphs[1]
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
for _ in range(n):
    graph.replay()
b.record()
torch.cuda.synchronize()
replay_ms = a.elapsed_time(b) / n
t0 = time.perf_counter()
for _ in range(n):
    graph.replay()
launch_ms = (time.perf_counter() - t0) * 1000 / n
torch.cuda.synchronize()
print(f"{engine.model}, {cfg.num_layers} layers, context {ctx}: ModelRunner.decode step {step_ms:.3f} ms; graph replay (GPU) {replay_ms:.3f} ms; "
      f"replay launch (host, queued) {launch_ms:.3f} ms")

# the step's host parts (wall time each, summed over n steps): the inputs built on the host, the graph's
# input copy and launch, the sampling and the wait for the tokens (which holds the replay's GPU time)
parts = {"_place_decode_tokens": 0.0, "graphs.run": 0.0, "_sampled": 0.0}


def timed_part(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        parts[name] += time.perf_counter() - start
        return result
    return wrapper


runner._place_decode_tokens = timed_part("_place_decode_tokens", runner._place_decode_tokens)
runner.graphs.run = timed_part("graphs.run", runner.graphs.run)
runner._sampled = timed_part("_sampled", runner._sampled)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(n):
    step()
parted_ms = (time.perf_counter() - t0) * 1000 / n
print(f"host parts per step (wall, of a {parted_ms:.3f} ms step): " +
      "; ".join(f"{k} {v * 1000 / n:.3f} ms" for k, v in parts.items()) +
      f"; _sampled less the replay's GPU time {parts['_sampled'] * 1000 / n - replay_ms:.3f} ms")
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
busy, kernels, table = kernel_table(prof, repeats=3, top=30)
print(f"kernels per replay: {kernels}; GPU busy per replay {busy:.3f} ms")
print(table)

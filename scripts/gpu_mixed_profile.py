"""A late chunk with and without the running sequences' decode step in the same forward pass, one GPU
(llama3-8b preset, bf16): ModelRunner.extend + ModelRunner.decode against ModelRunner.extend_and_decode,
for chunks of 256 and 512 tokens after ~C cached ones and 8 sequences of 1K decoding; then one mixed call
under torch.profiler. Usage: python scripts/gpu_mixed_profile.py [context]   (prints markdown tables)"""
import sys
import time

import torch
from profile_table import kernel_table

from burstserve.engine.calls import Decode, Extend, ExtendAndDecode, Prefill
from burstserve.engine.config import EngineConfig, resolve_model
from burstserve.engine.model_runner import ModelRunner
from burstserve.engine.worker import runner_alone

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 114688
dev = torch.device("cuda:0")
engine = EngineConfig(model="llama3-8b", devices=["cuda:0"], dtype="bfloat16", max_num_seqs=16, mixed_batch=True)
cfg, max_model_len = resolve_model(engine)
runner = ModelRunner(engine, cfg, 0, dev, None, max_model_len)
kv = runner_alone(runner)                       # places each call, then runs it here
prompt = torch.randint(0, 250, (ctx + 65536,))
streams = list(range(100, 108))
for s in streams:
    kv.call(Prefill(s, prompt[:1024]))
tokens, positions = [5] * 8, [1024] * 8
done = 0
while done < ctx:
    kv.call(Prefill(2, prompt[:8192])) if done == 0 else kv.call(Extend(2, prompt[done:done + 8192], done))
    done += 8192


def separate(n):
    global done, positions
    kv.call(Extend(2, prompt[done:done + n], done))
    kv.call(Decode(streams, tokens, positions))
    done, positions = done + n, [p + 1 for p in positions]


def eagerly(fn):
    """fn with the extend run eagerly (no engine/extend_graphs.py graph; decode steps still graphed)."""
    def run(n):
        graphs, runner.extend_graphs = runner.extend_graphs, None
        try:
            fn(n)
        finally:
            runner.extend_graphs = graphs
    return run


def mixed(n):
    global done, positions
    kv.call(ExtendAndDecode(Extend(2, prompt[done:done + n], done), Decode(streams, tokens, positions)))
    done, positions = done + n, [p + 1 for p in positions]


print(f"## a chunk after ~{ctx} cached tokens and a decode step of 8 x 1K sequences\n")
print("| chunk | separate ms | separate, eager extend ms | mixed ms | mixed, eager ms |\n|---|---|---|---|---|")
for n in (256, 512, 1024):
    times = {}
    for name, fn in (("separate", separate), ("separate_eager", eagerly(separate)), ("mixed", mixed),
                     ("mixed_eager", eagerly(mixed))):
        fn(n)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            fn(n)
        torch.cuda.synchronize()
        times[name] = (time.perf_counter() - t0) / 3 * 1e3
    print(f"| {n} (after {done}) | {times['separate']:.1f} | {times['separate_eager']:.1f} | {times['mixed']:.1f} "
          f"| {times['mixed_eager']:.1f} |")

from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CUDA]) as prof:
    mixed(256)
    torch.cuda.synchronize()
busy, kernels, table = kernel_table(prof)
print(f"\n## one mixed call of 256 + 8: GPU busy {busy:.1f} ms, kernels {kernels}\n")
print(table)

# Where the host's time goes: cProfile over one call of each, functions by own time (tottime), and the
# host time alone (the forward issued without waiting: the call's wall time minus its final sync).
import cProfile
import io
import pstats

for name, fn in (("separate", separate), ("mixed", mixed)):
    fn(256)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    fn(256)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(28)
    print(f"\n## cProfile, one {name} call of 256 (+ 8 decode rows), top functions by own time\n\n```")
    print("\n".join(line for line in text.getvalue().splitlines()[4:] if line.strip()))
    print("```")

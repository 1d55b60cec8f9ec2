"""Throwaway: where a question's extend (512 tokens after a 128K document) and a decode step at 128K go,
bf16 pages against FP8 pages, one GPU, llama3-8b preset; ModelRunner directly, torch.profiler."""
import sys, time
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, "scripts")
from engine.config import EngineConfig, resolve_model
from engine.model_runner import ModelRunner
import os
from engine.calls import Decode, Extend, Prefill
DEV = os.environ.get("DEV", "cuda")
MODEL = os.environ.get("MODEL", "llama3-8b")
CH = int(os.environ.get("CH", "65536"))

DOC = int(sys.argv[1]) if len(sys.argv) > 1 else 131072


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def top(prof, k=10):
    names, total = {}, 0.0
    for e in prof.events():
        if DEV == "cuda" and e.device_type.name != "CUDA":
            continue
        t = (e.device_time if DEV == "cuda" else e.cpu_time) / 1e3
        total += t
        names[e.name[:80]] = names.get(e.name[:80], 0.0) + t
    return total, sorted(names.items(), key=lambda kv: -kv[1])[:k]


def timed(fn, n=3):
    ts = []
    for _ in range(n):
        sync(); t0 = time.perf_counter(); fn(); sync()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3, sum(ts) / n * 1e3


for kv in sys.argv[2:] or ["auto", "fp8"]:
    engine = EngineConfig(model=MODEL, devices=[DEV], kv_cache_dtype=kv, max_num_batched_tokens=CH, dtype="bfloat16" if DEV == "cuda" else "float32")
    cfg, max_len = resolve_model(engine)
    runner = ModelRunner(engine, cfg, 0, torch.device(DEV), None, max_len)
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(0, cfg.vocab_size, (DOC,), generator=g)
    runner.prefill(Prefill(1, doc[:CH]))
    for s in range(CH, DOC, CH):
        runner.extend(Extend(1, doc[s:s + CH], s))
    q = torch.randint(0, cfg.vocab_size, (512,), generator=g)
    # the question: an extend of 512 after the document; truncate back each time
    from engine.calls import Truncate
    def question():
        runner.extend(Extend(1, q, DOC)); runner.truncate(Truncate(1, DOC))
    question()
    lo, mean = timed(question)
    with profile(activities=[ProfilerActivity.CUDA if DEV == "cuda" else ProfilerActivity.CPU]) as prof:
        question(); sync()
    total, t = top(prof)
    print(f"\n### kv {kv}: question extend 512 after {DOC}: wall min {lo:.1f} mean {mean:.1f} ms, GPU busy {total:.1f} ms")
    for name, ms in t:
        print(f"| {name} | {ms:.2f} |")
    # decode steps at DOC
    runner.extend(Extend(1, q[:1], DOC))
    pos = DOC + 1
    def step():
        nonlocal_pos[0] += 1
        runner.decode(Decode([1], [5], [nonlocal_pos[0]]))
    nonlocal_pos = [pos - 1]
    for _ in range(5):
        step()
    lo, mean = timed(lambda: [step() for _ in range(20)], 2)
    with profile(activities=[ProfilerActivity.CUDA if DEV == "cuda" else ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step()
        sync()
    total, t = top(prof)
    print(f"\n### kv {kv}: decode 1 x {DOC}: {lo / 20:.2f} ms a step (min of 2 x 20), GPU busy {total / 10:.2f} ms a step")
    for name, ms in t:
        print(f"| {name} | {ms / 10:.3f} |")
    del runner
    if DEV == "cuda":
        torch.cuda.empty_cache()

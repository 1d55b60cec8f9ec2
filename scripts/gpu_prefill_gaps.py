"""Where one GPU waits on the host during a prefill: the compute stream's idle gaps, the largest first, with the
kernels on either side and the Python frames (ours) that launched the kernel after each gap; and the time
from the call's start to its first kernel and from its last kernel to the call's end. What
gpu_prefill_profile.py counts as "host gap", taken apart. First, unprofiled: the host's timeline of the call
(ModelRunner.prefill's steps timed by wrapping them), where the GPU can only be idle before the forward's first
launch and after its queue drains.

    [KV=fp8 QUANT=fp8] python scripts/gpu_prefill_gaps.py [TOKENS] [GAPS]      (default 8192, 10; markdown)

One GPU, llama3-8b preset (MODEL=...; DEVICE=cpu MODEL=tiny: a dry run, the CPU's ops standing in for
kernels), the prompt prefilled three times to warm and for the host timeline, then once under torch.profiler
with the CPU's and the GPU's events and Python stacks (the profiler's own cost lengthens the host's share).
"""
import json
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine.calls import Free, Prefill
from engine.config import EngineConfig, resolve_model
from engine.model_runner import ModelRunner
from engine.worker import freeze_heap

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
OURS = ("engine/", "kernels/", "server/")


def trace_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def our_frames(events: list[dict], ts: float, depth: int = 3) -> str:
    """The innermost `depth` Python frames of this repository's code that enclose host time ts (µs)."""
    frames = [e for e in events if e.get("cat") == "python_function" and e["ts"] <= ts <= e["ts"] + e.get("dur", 0)
              and any(p in e["name"] for p in OURS)]
    frames.sort(key=lambda e: e["ts"])                       # outermost first
    return " < ".join(f["name"].split("/")[-1][:60] for f in reversed(frames[-depth:])) or "-"


def device_events(events: list[dict], categories) -> list[dict]:
    return sorted((e for e in events if e.get("cat") in categories), key=lambda e: e["ts"])


def gaps(gpu: list[dict], events: list[dict], top: int) -> list[str]:
    """The `top` largest idle times between consecutive device events gpu (sorted), as table rows."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    rows = []
    for before, after in zip(gpu, gpu[1:]):
        idle = after["ts"] - (before["ts"] + before.get("dur", 0))
        launch = launches.get(after.get("args", {}).get("correlation"))
        frames = our_frames(events, launch["ts"]) if launch else "-"
        rows.append((idle, before["name"][:50], after["name"][:50], frames))
    rows.sort(key=lambda r: -r[0])
    return [f"| {idle:.0f} | {b.replace('|', '/')} | {a.replace('|', '/')} | {frames} |"
            for idle, b, a, frames in rows[:top]]


def host_timeline(runner, prefill, runs: int = 3) -> list[tuple[str, float]]:
    """ModelRunner.prefill's steps timed on the host, unprofiled -> [(step, ms)], medians over `runs` calls:
    call entry -> the first _sync's return (the GPU's queue drained) -> the forward's entry (nothing queued on
    the GPU between: its idle start) -> the forward's return (host time to launch every layer) -> the second
    _sync's return (the GPU's work done) -> the call's return (the result's wrap-up: peak memory, logits)."""
    marks: list[tuple[str, float]] = []

    def timed(obj, name: str):
        inner = getattr(obj, name)

        def wrapper(*args, **kwargs):
            marks.append((name + " in", time.perf_counter()))
            out = inner(*args, **kwargs)
            marks.append((name + " out", time.perf_counter()))
            return out
        setattr(obj, name, wrapper)
        return lambda: setattr(obj, name, inner)

    undo = [timed(runner, "_sync"), timed(runner.model, "forward"), timed(runner, "prefill")]
    steps: dict[str, list[float]] = {}
    for seq in range(100, 100 + runs):
        marks.clear()
        prefill(seq)
        t0 = dict(marks)["prefill in"]
        t = dict.fromkeys(("first sync out", "forward in", "forward out", "second sync out"), 0.0)
        syncs = [m for name, m in marks if name == "_sync out"]
        t.update({"first sync out": syncs[0], "second sync out": syncs[1]})
        t.update({name: m for name, m in marks if name.startswith("forward")})
        end = dict(marks)["prefill out"]
        for step, a, b in (("call entry -> first _sync's return", t0, t["first sync out"]),
                           ("-> forward entry (GPU idle)", t["first sync out"], t["forward in"]),
                           ("-> forward return (host launching)", t["forward in"], t["forward out"]),
                           ("-> second _sync's return (GPU draining)", t["forward out"], t["second sync out"]),
                           ("-> last step's end (peak memory, logits)", t["second sync out"], end)):
            steps.setdefault(step, []).append((b - a) * 1e3)
    for u in undo:
        u()
    return [(step, sorted(v)[len(v) // 2]) for step, v in steps.items()]


def main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 8192
    top = int(argv[1]) if len(argv) > 1 else 10
    cuda = os.environ.get("DEVICE", "cuda") == "cuda"
    engine = EngineConfig(model=os.environ.get("MODEL", "llama3-8b"), devices=["cuda" if cuda else "cpu"],
                          dtype="bfloat16" if cuda else "float32", max_num_seqs=4,
                          kv_cache_dtype=os.environ.get("KV", "auto"), quantization=os.environ.get("QUANT", "none"))
    cfg, max_model_len = resolve_model(engine)
    runner = ModelRunner(engine, cfg, 0, torch.device(engine.devices[0]), None, max_model_len)
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    freeze_heap()                  # as a worker does after start-up: no full collection stalls a call
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def prefill(seq: int) -> float:
        t0 = time.perf_counter()
        runner.prefill(Prefill(seq, prompt))
        sync()
        wall = time.perf_counter() - t0
        runner.free(Free([seq]))
        return wall

    walls = [prefill(s) for s in (1, 2, 3)]
    timeline = host_timeline(runner, prefill)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=True) as prof:
        profiled = prefill(4)
    events = trace_events(prof)
    gpu = device_events(events, GPU_CATEGORIES if cuda else ("cpu_op",))
    call = max((e for e in events if e.get("cat") == "python_function" and e["name"].endswith(": prefill")
                and "gpu_prefill_gaps" in e["name"]), key=lambda e: e.get("dur", 0))
    busy = sum(e.get("dur", 0) for e in gpu)
    span = gpu[-1]["ts"] + gpu[-1].get("dur", 0) - gpu[0]["ts"]
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"{n} tokens, KV={engine.kv_cache_dtype}, QUANT={engine.quantization}, {name}: wall unprofiled "
          f"{min(walls) * 1e3:.1f} ms (min of 3), profiled {profiled * 1e3:.1f} ms; device events {len(gpu)}, "
          f"busy {busy / 1e3:.1f} ms over a span of {span / 1e3:.1f} ms\n")
    print("| the call, unprofiled (medians of 3) | ms |\n|---|---|")
    for step, ms in timeline:
        print(f"| {step} | {ms:.2f} |")
    print("\n| the profiled call | µs |\n|---|---|")
    print(f"| call start -> first device event | {gpu[0]['ts'] - call['ts']:.0f} |")
    print(f"| idle between device events, summed | {span - busy:.0f} |")
    last_end = gpu[-1]["ts"] + gpu[-1].get("dur", 0)
    print(f"| last device event's end -> call end | {call['ts'] + call['dur'] - last_end:.0f} |")
    print("\n| idle µs | before | after | launched from (ours, innermost first) |\n|---|---|---|---|")
    print("\n".join(gaps(gpu, events, top)))


if __name__ == "__main__":
    main(sys.argv[1:])

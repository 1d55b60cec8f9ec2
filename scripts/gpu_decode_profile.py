"""Where a decode step's time goes on one GPU or CP (llama3-8b preset, bf16, one 8K-token sequence):
the whole step as the scheduler calls it (ModelRunner.decode), the CUDA graph's replay alone, and
the replay's kernels by GPU time (torch.profiler). Usage: [MODEL=preset] [LAYERS=N] [CHUNK=N] [KV=fp8] [QUANT=fp8] python scripts/gpu_decode_profile.py [context]
(LAYERS=N keeps the preset's first N layers: a proxy of a model larger than one GPU.)
CP=G [SP=strategy]: on G GPUs, one ModelRunner per process of this script (NCCL, as engine/worker.py sets
them up), --sp-strategy SP (default: EngineConfig's); worker 0 prints the tables above (its own), then
every worker's replay by kind of kernel (GEMM, attention, NCCL, other), NCCL kernels a step and step wall
time: e.g. CP=2 SP=burst-zero, the weight slices' GEMMs against a layer's collectives.
DEVICE=cpu MODEL=tiny [CP=2] ... 256: a dry run on CPU (gloo, float32, eager steps, CPU ops as kernels)."""
import dataclasses
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile
from profile_table import kernel_table
from gpu_prefill_profile import kind_of

from burstserve.engine.core.calls import Decode, Extend, Prefill
from burstserve.engine.model.config import EngineConfig, ModelConfig, resolve_model
from burstserve.engine.runner import model_runner
from burstserve.engine.runner.model_runner import ModelRunner
from burstserve.engine.worker import host_threads, runner_alone

ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
CHUNK = int(os.environ.get("CHUNK", "0"))       # > 0: prefill in chunks of CHUNK (the pool sized for them): 512K fits
WORLD = int(os.environ.get("CP", "1"))
SP, DEVICE = os.environ.get("SP", EngineConfig.sp_strategy), os.environ.get("DEVICE", "cuda")
SUMMARY_KINDS = ("gemm", "attention", "nccl", "other")
# the paged decode's own kernels (FP8 pages; the split's prep and merge): attention
DECODE_ATTENTION = ("decode_kernel", "_prep_kernel", "merge_partials_kernel", "merge_into_kernel")


def build(rank: int) -> tuple[EngineConfig, ModelConfig, ModelRunner]:
    """This worker's ModelRunner (the process group joined first when G > 1) -> (engine, model config, runner)."""
    cuda = DEVICE == "cuda"
    devices = [f"cuda:{i}" for i in range(WORLD)] if cuda else ["cpu"] * WORLD
    dev = torch.device(devices[rank])
    if WORLD > 1:                                           # as engine/worker.py's _setup_device and _init_groups
        if cuda:
            torch.cuda.set_device(dev)
        torch.set_num_threads(host_threads(WORLD))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29534")
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD,
                                **({"device_id": dev} if cuda else {}))
    engine = EngineConfig(model=os.environ.get("MODEL", "llama3-8b"), devices=devices,
                          dtype="bfloat16" if cuda else "float32", max_num_seqs=16, sp_strategy=SP,
                          max_num_batched_tokens=CHUNK or None, kv_cache_dtype=os.environ.get("KV", "auto"),
                          quantization=os.environ.get("QUANT", "none"))
    cfg, max_model_len = resolve_model(engine)
    if int(os.environ.get("LAYERS", "0")):
        cfg = dataclasses.replace(cfg, num_layers=int(os.environ["LAYERS"]))
        max_model_len = min(max_model_len, ctx + 1024)
    return engine, cfg, ModelRunner(engine, cfg, rank, dev, None, max_model_len)


def prefill(kv) -> None:
    """The same prompt of ctx tokens on every worker (seeded), whole or in chunks of CHUNK (kv: runner_alone's)."""
    prompt = torch.randint(0, 250, (ctx,), generator=torch.Generator().manual_seed(0))
    if CHUNK:
        kv.call(Prefill(0, prompt[:CHUNK]))
        for start in range(CHUNK, ctx, CHUNK):
            kv.call(Extend(0, prompt[start:start + CHUNK], start))
    else:
        kv.call(Prefill(0, prompt))


def replay_of(runner: ModelRunner, state: SimpleNamespace):
    """The step's forward alone, to call again and again: the batch-1 CUDA graph's replay (the last step's
    inputs), or eagerly (CPU) one more token's forward (its slot written again at each call, as a replay does)."""
    if runner.graphs is not None:
        return runner.graphs.graphs[1].replay
    inputs = runner.cache.place_decode_tokens(state.kv.place(Decode([0], [state.tok], [state.pos])))   # [5, 1]
    state.pos += 1
    pages, eager = len(runner.pool.pages[0]), runner._decode_eager
    return torch.inference_mode()(lambda: eager(inputs, pages))


def device_ms(fn, n: int, cuda: bool) -> float:
    """fn() n times -> ms a call on the device's clock (CUDA events; on CPU the wall clock)."""
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) * 1000 / n
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


def as_kernels(prof):
    """CPU dry run: the profiler's CPU ops (self time) dressed as CUDA kernels, for kernel_table and by_kind."""
    cuda = SimpleNamespace(name="CUDA")
    ops = [SimpleNamespace(name=e.name, device_type=cuda, device_time=e.self_cpu_time_total)
           for e in prof.events() if e.device_type.name == "CPU"]
    return SimpleNamespace(events=lambda: ops)


def summary_kind(name: str) -> str:
    """gemm, attention, nccl (any collective) or other: gpu_prefill_profile's kinds, with the decode's own
    attention kernels, cuBLAS's GEMV and on CPU the ops of a dry run added."""
    kind = kind_of(name)
    low = name.lower()
    if kind in ("gemm", "attention", "nccl"):
        return kind
    if "gemv" in low or "splitkreduce" in low or low in ("aten::mm", "aten::addmm"):   # (aten: the CPU dry run)
        return "gemm"
    if low.startswith("c10d::"):
        return "nccl"
    return "attention" if name.startswith(DECODE_ATTENTION) else "other"


def by_kind(prof, repeats: int) -> tuple[dict[str, float], int]:
    """-> (GPU ms a replay by summary kind, NCCL kernels a replay). NCCL's time holds its wait for the peers."""
    ms, nccl = dict.fromkeys(SUMMARY_KINDS, 0.0), 0
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kind = summary_kind(e.name)
            ms[kind] += e.device_time / 1e3 / repeats
            nccl += kind == "nccl"
    return ms, nccl // repeats


def run(rank: int) -> None:
    cuda = DEVICE == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    say = print if rank == 0 else (lambda *a, **k: None)
    engine, cfg, runner = build(rank)
    kv = runner_alone(runner)
    prefill(kv)
    state = SimpleNamespace(tok=5, pos=ctx, kv=kv)

    def step():
        result = kv.call(Decode([0], [state.tok], [state.pos]))   # worker 0 only: the tokens
        if WORLD == 1:          # on G workers the input token stays: the others do not see the sampled one
            state.tok = result.tokens[0]
        state.pos += 1

    for _ in range(5):
        step()
    sync()
    n = 100
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()                      # worker 0 waits for its tokens each step, the others only here
    step_ms = (time.perf_counter() - t0) * 1000 / n
    replay = replay_of(runner, state)
    replay_ms = device_ms(replay, n, cuda)
    t0 = time.perf_counter()
    for _ in range(n):
        replay()
    launch_ms = (time.perf_counter() - t0) * 1000 / n
    sync()
    if WORLD > 1:
        say(f"{WORLD} workers ({DEVICE}), --sp-strategy {SP}; worker 0's figures first")
    say(f"{engine.model}, {cfg.num_layers} layers, context {ctx}: ModelRunner.decode step {step_ms:.3f} ms; graph replay (GPU) {replay_ms:.3f} ms; "
        f"replay launch (host, queued) {launch_ms:.3f} ms")

    # the step's host parts (wall time each, summed over n steps): the KV manager's placement, the inputs built
    # on the host, the graph's
    # input copy and launch (eager on CPU: the forward), the sampling and the wait for the tokens (which
    # holds the replay's GPU time)
    forward = "graphs.run" if runner.graphs is not None else "_decode_eager"
    parts = {"kv.place": 0.0, "cache.place_decode_tokens": 0.0, forward: 0.0, "sampled_result": 0.0}

    def timed_part(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            parts[name] += time.perf_counter() - start
            return result
        return wrapper

    kv.place = timed_part("kv.place", kv.place)         # what runner_alone's call runs before the step
    runner.cache.place_decode_tokens = timed_part("cache.place_decode_tokens", runner.cache.place_decode_tokens)
    if runner.graphs is not None:
        runner.graphs.run = timed_part(forward, runner.graphs.run)
    else:
        runner._decode_eager = timed_part(forward, runner._decode_eager)
    model_runner.sampled_result = timed_part("sampled_result", model_runner.sampled_result)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    parted_ms = (time.perf_counter() - t0) * 1000 / n
    say(f"host parts per step (wall, of a {parted_ms:.3f} ms step): " +
        "; ".join(f"{k} {v * 1000 / n:.3f} ms" for k, v in parts.items()) +
        f"; sampled_result less the replay's GPU time {parts['sampled_result'] * 1000 / n - replay_ms:.3f} ms")
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            replay()
        sync()
    kernels_of = prof if cuda else as_kernels(prof)
    busy, kernels, table = kernel_table(kernels_of, repeats=3, top=30)
    say(f"kernels per replay: {kernels}; GPU busy per replay {busy:.3f} ms")
    say(table)
    if WORLD > 1:
        every_worker(rank, (rank, step_ms, replay_ms, busy, kernels, *by_kind(kernels_of, 3)), say)
        runner.release_graphs()     # before the group: a graph that captured NCCL calls holds its communicator
        dist.destroy_process_group()


def every_worker(rank: int, row: tuple, say) -> None:
    """Every worker's row, gathered to worker 0 and printed there: where a replay's GPU time goes by kind,
    how many collectives a step launches, and the step's wall time."""
    rows = [None] * WORLD
    dist.all_gather_object(rows, row)
    say(f"\n## every worker: a step's wall time and its replay's GPU time by kind (ms, --sp-strategy {SP})\n")
    say("| worker | step (wall) | replay (GPU) | kernels busy | GEMM | attention | NCCL | other | NCCL kernels "
        "| kernels |\n|---|---|---|---|---|---|---|---|---|---|")
    for w, step_ms, replay_ms, busy, kernels, ms, nccl in rows:
        say(f"| {w} | {step_ms:.3f} | {replay_ms:.3f} | {busy:.3f} | {ms['gemm']:.3f} | {ms['attention']:.3f} | "
            f"{ms['nccl']:.3f} | {ms['other']:.3f} | {nccl} | {kernels} |")


if __name__ == "__main__":
    if WORLD == 1:
        run(0)
    else:
        mp.spawn(run, nprocs=WORLD)

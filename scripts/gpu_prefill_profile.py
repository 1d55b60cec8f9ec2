"""Where a prefill's time goes on G GPUs (llama3-8b preset or MODEL's, bf16, burst; G = CP, default 1), against the
floor arithmetic of issue 13: per prompt length, the wall time of ModelRunner.prefill, worker 0's GPU
time by kind of kernel under torch.profiler (attention, GEMMs, fused Triton kernels, other elementwise,
copies; NCCL apart: it runs on the ring's own stream), the ring's exposed exchange wait, the host's
share, each kind's FLOP rate, and what a new prompt length costs the first time. With G > 1 the G
workers are this script's own processes (NCCL, as engine/worker.py sets them up), each a ModelRunner.
Usage: [CP=2] python scripts/gpu_prefill_profile.py [lengths, comma-separated]  (markdown tables)
LAYERS=N keeps the preset's first N layers (a proxy: e.g. llama3-70b's shapes with 20 of its 80 layers fit
one GPU; per-layer time scales the figures to the whole model). KV=fp8 and QUANT=fp8: FP8 pages and linears; KERNEL=fa3_fp8: FP8 attention.
TRACE=folder: each worker's chrome trace of its profiled prefill (host ops and kernels) goes there.
(The floor columns assume bf16 rates.)"""
import dataclasses
import os
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

import torch
from torch.profiler import ProfilerActivity, profile

from burstserve.engine.core.calls import Prefill
from burstserve.engine.model.config import EngineConfig, resolve_model
from burstserve.engine.runner.model_runner import ModelRunner
from burstserve.engine.worker import host_threads, runner_alone

LENGTHS = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8192,32768,131072").split(",")]
WORLD = int(os.environ.get("CP", "1"))
MODEL, DEVICE = os.environ.get("MODEL", "llama3-8b"), os.environ.get("DEVICE", "cuda")
LAYERS = int(os.environ.get("LAYERS", "0"))       # 0: the preset's own   # DEVICE=cpu MODEL=tiny: a dry run
GEMM_TFLOPS, ATTENTION_TFLOPS = 783.0, 644.0     # issue 13's kernel rates on one H200 (bf16 GEMM, causal attention)
TOP = int(os.environ.get("TOP", "12"))           # kernels listed a length
TRACE = os.environ.get("TRACE", "")              # a folder: each worker's chrome trace (host and GPU) goes there
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
    if low.startswith(("rms_norm", "rope_kernel", "silu_and_mul", "store_kv", "quantize_", "merge_into_kernel",
                       "merge_partials_kernel", "_prep_kernel", "gather_kernel", "_pair_kernel", "reduce_kernel",
                       "head_norm_kernel", "silu_mul_scaled_kernel", "sum_choices_kernel", "gate_up_kernel",
                       "down_kernel")):   # ours
        return "triton"
    return "elementwise"


def flops(cfg, n: int) -> tuple[float, float]:
    """(linear FLOPs, causal attention FLOPs) of a prefill of n tokens: the LM head for one row."""
    d, hkv_d, q_d = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.num_heads * cfg.head_dim
    sparse = len(cfg.sparse_layers)                                        # a mixture of experts' layers
    experts = cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size  # a token's chosen experts
    per_token = d * q_d * 2 + d * hkv_d * 2                                # q, o; k, v
    mlps = (cfg.num_layers - sparse) * 3 * d * cfg.intermediate_size + sparse * experts    # gate, up, down
    linear = 2.0 * n * (per_token * cfg.num_layers + mlps) + 2.0 * d * cfg.vocab_size
    attention = 2.0 * n * n * cfg.num_heads * cfg.head_dim * cfg.num_layers   # QK and PV, half the square each
    return linear, attention


def by_kind(prof) -> tuple[dict[str, float], int, list[tuple[str, float]]]:
    """GPU ms by kind, kernel count, and the top kernels by GPU ms (NCCL's kernels on their own
    stream overlap the others: their time is not part of the compute stream's busy time)."""
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
    return ms, count, sorted(names.items(), key=lambda kv: -kv[1])[:TOP]


def run(rank: int) -> None:
    cuda = DEVICE == "cuda"
    devices = [f"cuda:{i}" for i in range(WORLD)] if cuda else ["cpu"] * WORLD
    dev = torch.device(devices[rank])
    if cuda:
        torch.cuda.set_device(dev)
    torch.set_num_threads(host_threads(WORLD))                    # as an engine worker
    if WORLD > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD,
                                **({"device_id": dev} if cuda else {}))
    engine = EngineConfig(model=MODEL, devices=devices, dtype="bfloat16" if cuda else "float32", max_num_seqs=4,
                          kv_cache_dtype=os.environ.get("KV", "auto"), quantization=os.environ.get("QUANT", "none"),
                          kernel=os.environ.get("KERNEL", "auto"))
    cfg, max_model_len = resolve_model(engine)
    if LAYERS:
        cfg = dataclasses.replace(cfg, num_layers=LAYERS)
        max_model_len = min(max_model_len, max(LENGTHS) + 256)
    runner = ModelRunner(engine, cfg, rank, dev, None, max_model_len)
    kv = runner_alone(runner)                   # places each call, then runs it here
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"model: {MODEL}, {cfg.num_layers} layers; attention backend: {runner.backend.name}; {WORLD} x {torch.cuda.get_device_name(0) if cuda else 'cpu'}\n")
    prompt = torch.randint(0, cfg.vocab_size, (max(LENGTHS),), generator=torch.Generator().manual_seed(0))
    seq = iter(range(1, 1 << 20))

    def prefill(n: int) -> tuple[float, float]:
        """-> (wall s, exposed exchange s) of one prefill of the prompt's first n tokens."""
        s = next(seq)
        wall0 = time.perf_counter()
        result = kv.call(Prefill(s, prompt[:n]))
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - wall0
        kv.free([s])
        return wall, result.exposed_seconds or 0.0

    rows, firsts, tops = [], [], {}
    for n in LENGTHS:
        prefill(n)                                   # warm this length
        timed = [prefill(n) for _ in range(3)]
        activities = {ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU}
        activities |= {ProfilerActivity.CPU} if TRACE else set()
        with profile(activities=list(activities)) as prof:
            profiled, exposed = prefill(n)
        if TRACE:                                    # each worker's timeline, for chrome://tracing or a script
            prof.export_chrome_trace(os.path.join(TRACE, f"trace_{n}_worker{rank}.json"))
        ms, count, top = by_kind(prof)
        linear, attention = flops(cfg, n)
        walls = [w for w, _ in timed]
        rows.append((n, min(walls), sum(walls) / 3, profiled, exposed, ms, count, linear, attention))
        tops[n] = top
        new = n - 64                                 # a length never seen: its first call against its second
        firsts.append((new, prefill(new)[0], prefill(new)[0]) if not TRACE else (new, 0.0, 0.0))

    say(f"## prefill on {WORLD} GPU(s), worker 0: wall time against GPU time by kind (ms) and the floor\n")
    say("| tokens | wall mean (min) | compute busy | attention | GEMM | Triton fused | other elementwise | copies "
        "| NCCL (own stream) | exposed exchange | host gap | kernels | floor (GEMM 783, attn 644 TF/s) | floor / wall |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, lo, mean, profiled, exposed, ms, count, linear, attention in rows:
        busy = sum(v for k, v in ms.items() if k != "nccl")
        floor = (linear / GEMM_TFLOPS / 1e9 + attention / ATTENTION_TFLOPS / 1e9) / WORLD    # ms
        say(f"| {n} | {mean * 1e3:.1f} ({lo * 1e3:.1f}) | {busy:.1f} | {ms['attention']:.1f} | {ms['gemm']:.1f} | "
            f"{ms['triton']:.1f} | {ms['elementwise']:.1f} | {ms['copy']:.1f} | {ms['nccl']:.1f} | {exposed * 1e3:.1f} | "
            f"{(profiled - exposed) * 1e3 - busy:.1f} | {count} | {floor:.1f} | {floor / (mean * 1e3):.0%} |")
    say("\n## rates on worker 0: its share of the FLOPs over each kind's GPU time (TFLOP/s)\n")
    say("| tokens | linear TFLOP | GEMM TFLOP/s | attention TFLOP | attention TFLOP/s |\n|---|---|---|---|---|")
    for n, lo, mean, profiled, exposed, ms, count, linear, attention in rows:
        rate = lambda f, t: f / WORLD / max(t, 1e-9) / 1e9          # noqa: E731  (ms -> TFLOP/s)
        say(f"| {n} | {linear / WORLD / 1e12:.1f} | {rate(linear, ms['gemm']):.0f} | "
            f"{attention / WORLD / 1e12:.1f} | {rate(attention, ms['attention']):.0f} |")
    say("\n## a new prompt length: its first prefill against its second (s)\n")
    say("| tokens | first | second | first - second |\n|---|---|---|---|")
    for new, first, second in firsts:
        say(f"| {new} | {first:.3f} | {second:.3f} | {first - second:.3f} |")
    for n, top in tops.items():
        say(f"\n## top kernels at {n} tokens on worker 0 (GPU ms)\n\n| kernel | ms | kind |\n|---|---|---|")
        for name, t in top:
            say(f"| {name.replace('|', '/')} | {t:.2f} | {kind_of(name)} |")
    if WORLD > 1:
        per_worker(rank, rows, say)
        dist.destroy_process_group()


def per_worker(rank: int, rows: list, say) -> None:
    """Every worker's own figures side by side: a worker that waits at the ring (exposed) while its
    peer stays busy points at an imbalance between the workers, not at the link."""
    mine = [(rank, n, mean, exposed, ms) for n, _, mean, _, exposed, ms, *_ in rows]
    every = [None] * WORLD
    dist.all_gather_object(every, mine)
    say("\n## every worker (ms): a worker's exposed wait against its peers' busy time\n")
    say("| tokens | worker | wall mean | compute busy | attention | GEMM | Triton fused | NCCL (own stream) "
        "| exposed exchange |\n|---|---|---|---|---|---|---|---|---|")
    for i in range(len(rows)):
        for worker_rows in every:
            w, n, mean, exposed, ms = worker_rows[i]
            busy = sum(v for k, v in ms.items() if k != "nccl")
            say(f"| {n} | {w} | {mean * 1e3:.1f} | {busy:.1f} | {ms['attention']:.1f} | {ms['gemm']:.1f} | "
                f"{ms['triton']:.1f} | {ms['nccl']:.1f} | {exposed * 1e3:.1f} |")


if __name__ == "__main__":
    if WORLD == 1:
        run(0)
    else:
        mp.spawn(run, nprocs=WORLD)

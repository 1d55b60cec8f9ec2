"""A decode step's collectives on two GPUs, each inside a CUDA graph of REPS back-to-back calls (us a call):
NCCL's all-reduce and all-gather against PyTorch's symmetric-memory one-shot and two-shot all-reduce (no
multicast), and an all-gather made of a one-shot sum over a zeroed buffer (each worker writes its own slot).
Sizes: burst-zero's decode at batch 1, 16 and 64 (llama3-8b: hidden 4096 bf16, q/k/v of a worker's heads 3072
bf16, the attention partials 32 x 128 fp32). Usage: python collectives.py (needs 2 GPUs)."""
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm
import torch.multiprocessing as mp

REPS = 50
SIZES = [("all-reduce hidden", "ar", 4096, torch.bfloat16), ("all-gather q/k/v", "ag", 3072, torch.bfloat16),
         ("all-gather partials", "ag", 32 * 128 + 32, torch.float32)]
BATCHES = (1, 16, 64)


def graph_time(fn) -> float:
    """us a call of fn, REPS calls captured in one CUDA graph, best of 5 replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    best = float("inf")
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / REPS)
    return best


def safe(fn) -> float:
    """graph_time(fn), or NaN with the error printed (a symmetric-memory op this build or GPU lacks)."""
    try:
        return graph_time(fn)
    except Exception as e:                                   # noqa: BLE001 (a measurement, reported)
        print(f"rank {dist.get_rank()}: {type(e).__name__}: {str(e)[:300]}")
        return float("nan")


def same(fn, check) -> bool | str:
    try:
        fn()
        torch.cuda.synchronize()
        return bool(check())
    except Exception as e:                                   # noqa: BLE001
        return type(e).__name__


def run(rank: int, world: int) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    group = dist.group.WORLD
    name = group.group_name
    buf = symm.empty(64 * 8192 * world, dtype=torch.float32, device=dev)   # large enough for every row
    symm.rendezvous(buf, name)
    rows = []
    for label, kind, width, dtype in SIZES:
        for b in BATCHES:
            x = torch.randn(b, width, device=dev, dtype=dtype)
            cell = {}
            if kind == "ar":
                cell["nccl"] = graph_time(lambda: dist.all_reduce(x))
                sym = buf.view(dtype)[: x.numel()].view_as(x)
                out = torch.empty_like(x)

                def one_shot():
                    sym.copy_(x)
                    torch.ops.symm_mem.one_shot_all_reduce_out(sym, "sum", name, out)

                def two_shot():
                    sym.copy_(x)
                    torch.ops.symm_mem.two_shot_all_reduce_(sym, "sum", name)
                cell["symm one-shot"] = safe(one_shot)
                cell["symm two-shot"] = safe(two_shot)
                ref = x.clone()
                dist.all_reduce(ref)
                cell["same"] = same(one_shot, lambda: torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2))
            else:
                gathered = torch.empty(world, *x.shape, device=dev, dtype=dtype)
                cell["nccl"] = graph_time(lambda: dist.all_gather_into_tensor(gathered, x))
                sym = buf.view(dtype)[: world * x.numel()].view(world, *x.shape)
                summed = torch.empty_like(sym)

                def sum_gather():
                    sym.zero_()
                    sym[rank].copy_(x)
                    torch.ops.symm_mem.one_shot_all_reduce_out(sym, "sum", name, summed)
                cell["symm one-shot"] = safe(sum_gather)
                ref = torch.empty_like(gathered)
                dist.all_gather_into_tensor(ref, x)
                cell["same"] = same(sum_gather, lambda: torch.equal(summed, ref))
            rows.append((label, b, x.numel() * x.element_size(), cell))
    if rank == 0:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, world {world}, {REPS} calls a graph")
        print("| collective | batch | bytes a worker | NCCL us | symm one-shot us | symm two-shot us | same values |")
        print("|---|---|---|---|---|---|---|")
        for label, b, nbytes, c in rows:
            two = f"{c['symm two-shot']:.1f}" if "symm two-shot" in c else "-"
            print(f"| {label} | {b} | {nbytes} | {c['nccl']:.1f} | {c['symm one-shot']:.1f} | {two} | {c['same']} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    mp.spawn(run, args=(2,), nprocs=2)

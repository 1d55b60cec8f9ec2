"""Runs a function on G CPU processes joined by gloo, and returns what each rank returned."""
import io
import socket
import traceback

import torch

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, results):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        buffer = io.BytesIO()   # plain bytes: tensors shared by fd would vanish with this process
        torch.save(fn(rank, world_size, *args), buffer)
        results.put((rank, buffer.getvalue(), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """fn(rank, world_size, *args) on each of world_size processes; re-raises a rank's failure."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            rank, value, error = results.get(timeout=timeout)
            if error:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [out[r] for r in range(world_size)]

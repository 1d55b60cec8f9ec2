"""What one call of worker 0 costs on the control plane (engine/control.py): gloo's broadcast_object_list
against the pipes, for W workers and the calls a server makes (a decode step of 16 sequences, a 256-token
chunk, a 128K-token prefill).

Per call: `send` = the time worker 0 spends in `send` before it can run its own share of the call;
`last in` = from the start of that send to the slowest other worker holding the unpickled call (one
system-wide monotonic clock). Calls are 2 ms apart, as a decode loop's are (latency, not throughput); a
barrier before each kind of call (every worker started and waiting).
CPU only: `python scripts/control_latency.py [W ...]` (default 2 4). Prints a markdown table.
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from burstserve.engine.control import GlooControl, PipeControl, close_parent_ends, make_pipes

CALLS = 300
GAP_S = 0.002


def messages() -> dict[str, tuple[str, tuple]]:
    return {"decode step, 16 sequences": ("decode", (list(range(16)), list(range(1000, 1016)),
                                                     list(range(8192, 8208)), None)),
            "chunk of 256 tokens": ("extend", (3, torch.randint(0, 128256, (256,)), 114688)),
            "prefill of 131072 tokens": ("prefill", (3, torch.randint(0, 128256, (131072,)), None))}


def worker(rank: int, world: int, port: int, kind: str, pipes, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if kind == "gloo":
        control = GlooControl(dist.new_group(backend="gloo"))
    else:
        control = PipeControl(writers=pipes) if rank == 0 else PipeControl(reader=pipes)
    times = {}
    for label, (name, args) in messages().items():
        dist.barrier()                      # every worker started and waiting, as in the engine
        sends, arrivals = [], []
        for _ in range(CALLS):
            if rank == 0:
                start = time.monotonic_ns()
                control.send(name, args)
                sends.append((start, time.monotonic_ns() - start))
                time.sleep(GAP_S)
            else:
                control.receive()
                arrivals.append(time.monotonic_ns())
        times[label] = sends if rank == 0 else arrivals
    results.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, kind: str, port: int) -> dict[str, tuple[float, float]]:
    ctx = mp.get_context("spawn")
    writers, readers = make_pipes(ctx, world) if kind == "pipe" else ([], [None] * world)
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, kind, writers if r == 0 else readers[r], results))
             for r in range(world)]
    for p in procs:
        p.start()
    close_parent_ends(writers, readers)
    got = dict(results.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    table = {}
    for label in messages():
        sends = got[0][label]
        last_in = [max(got[r][label][i] for r in range(1, world)) - sends[i][0] for i in range(CALLS)]
        table[label] = (statistics.median(s for _, s in sends) / 1e3, statistics.median(last_in) / 1e3)
    return table


def main() -> None:
    worlds = [int(w) for w in sys.argv[1:]] or [2, 4]
    print("| workers | call | gloo send us | gloo last in us | pipes send us | pipes last in us |")
    print("|---|---|---|---|---|---|")
    for i, world in enumerate(worlds):
        gloo, pipe = measure(world, "gloo", 29700 + 2 * i), measure(world, "pipe", 29701 + 2 * i)
        for label in messages():
            print(f"| {world} | {label} | {gloo[label][0]:.0f} | {gloo[label][1]:.0f} | "
                  f"{pipe[label][0]:.0f} | {pipe[label][1]:.0f} |", flush=True)


if __name__ == "__main__":
    main()

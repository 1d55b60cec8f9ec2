"""Does the ring's K/V exchange run beside the own-block attention? One table, 2+ GPUs.

A BurstAttention layer sends its K/V block to the next rank, then attends its queries to its own block
(causal). The exchange is an NCCL kernel on a side stream: it needs SMs, and a kernel launched after the
attention's grid waits until every CTA of that grid has been dispatched, so it can run after the attention
instead of beside it. Per variant, at one worker's shapes (TOKENS rows, default 65536: a 128K prompt's shard
on 2 GPUs; llama3-8b's 32 query and 8 KV heads, d 128, bf16; the engine's attention backend):
compute alone, exchange alone, both together; hidden = (compute + exchange - together) / exchange.
  normal priority        the engine: exchange issued on a normal-priority side stream, then the attention
  high priority          the same on a high-priority side stream (its CTAs are dispatched first)
  a kernel in between    normal priority, and a copy as large as the layer's K/V store between the exchange
                         and the attention: the exchange's kernel is dispatched before the attention's grid
  a tiny kernel between  the same with a one-element fill instead of the copy (what engine/parallel/ring.py does)
Usage: [TOKENS=65536] python scripts/overlap_experiment.py   (markdown table; all of the node's GPUs)
"""
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ITERS = 10
TOKENS = int(os.environ.get("TOKENS", "65536"))
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def timed(fn, dev) -> float:
    dist.barrier()
    torch.cuda.synchronize(dev)
    start = time.perf_counter()
    for _ in range(ITERS):
        fn()
    torch.cuda.synchronize(dev)
    seconds = (time.perf_counter() - start) / ITERS
    dist.barrier()
    return seconds


def rank_main(rank: int, world: int, port: int) -> None:
    from kernels.attention import select_backend
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    attn = select_backend(dev, torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM)
    q = torch.randn(TOKENS, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(TOKENS, 2, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)   # [n, 2, Hkv, D]
    recv, scratch = torch.empty_like(kv), torch.empty_like(kv)
    attend = lambda: attn(q, kv[:, 0], kv[:, 1], True, HEAD_DIM ** -0.5)           # noqa: E731
    nudge = torch.zeros(1, device=dev)
    fills = {"store": lambda: scratch.copy_(kv), "tiny": nudge.zero_, None: None}
    side = {"normal": torch.cuda.Stream(dev, priority=0), "high": torch.cuda.Stream(dev, priority=-1)}

    def exchange(priority: str):
        stream = side[priority]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt), dist.P2POp(dist.irecv, recv, prv)]):
                w.wait()

    def together(priority: str, between: str | None):
        def go():
            exchange(priority)
            if between:
                fills[between]()
            attend()
            torch.cuda.current_stream().wait_stream(side[priority])
        return go

    for _ in range(3):
        attend()
        exchange("normal")
    t_exchange = timed(lambda: exchange("normal"), dev)
    t_attend = timed(attend, dev)
    t_attend_store = timed(lambda: (fills["store"](), attend()), dev)
    rows = []
    for name, priority, between, alone in (("normal priority", "normal", None, t_attend),
                                           ("high priority", "high", None, t_attend),
                                           ("a kernel in between", "normal", "store", t_attend_store),
                                           ("a tiny kernel in between", "normal", "tiny", t_attend)):
        both = timed(together(priority, between), dev)
        rows.append((name, alone * 1e3, t_exchange * 1e3, both * 1e3, (alone + t_exchange - both) / t_exchange))
    if rank == 0:
        print(f"world {world}; {TOKENS} tokens a worker; K/V block {kv.numel() * 2 / 2**20:.0f} MiB; "
              f"attention backend {attn.name}; {torch.cuda.get_device_name(dev)}")
        print("| exchange | compute ms | exchange alone ms | together ms | hidden |\n|---|---|---|---|---|")
        for name, c, e, b, h in rows:
            print(f"| {name} | {c:.2f} | {e:.2f} | {b:.2f} | {h:.0%} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    world = torch.cuda.device_count()
    mp.spawn(rank_main, args=(world, port), nprocs=world)

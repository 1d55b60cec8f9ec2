"""Which K/V exchange overlaps with cuDNN attention on these GPUs? One table, 2+ GPUs.

A 16K-token K/V block ([16384, 2, 8, 128] bf16, 64 MiB: the 128K-token prompt's shard on 8 GPUs)
travels to the next rank while a 16K x 16K cuDNN attention (32 heads, d=128) runs. Per variant:
compute alone, exchange alone, both together; hidden = (compute + exchange - together) / exchange.
"""
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ITERS = 20


def timed(fn, dev) -> float:
    dist.barrier()
    torch.cuda.synchronize(dev)
    start = time.perf_counter()
    for _ in range(ITERS):
        fn()
    torch.cuda.synchronize(dev)
    t = (time.perf_counter() - start) / ITERS
    dist.barrier()
    return t


def rank_main(rank, world, port):
    from kernels.attention import AttentionBackend, _GPU_BACKENDS
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    attn = AttentionBackend("cudnn", _GPU_BACKENDS["cudnn"])
    q = torch.randn(16384, 32, 128, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(16384, 2, 8, 128, device=dev, dtype=torch.bfloat16)
    recv = torch.empty_like(kv)
    compute = lambda: attn(q, kv[:, 0], kv[:, 1], False, 128 ** -0.5)
    high, normal = torch.cuda.Stream(dev, priority=-1), torch.cuda.Stream(dev, priority=0)

    def nccl(stream):
        def go():
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt), dist.P2POp(dist.irecv, recv, prv)]):
                    w.wait()
        return go

    import torch.distributed._symmetric_memory as symm_mem
    slot = symm_mem.empty(kv.shape, dtype=kv.dtype, device=dev)
    hdl = symm_mem.rendezvous(slot, dist.group.WORLD)
    peer = hdl.get_buffer(prv, list(kv.shape), kv.dtype, 0)
    slot.copy_(kv)
    torch.cuda.synchronize(dev)

    def pull(stream):
        def go():
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                hdl.barrier(channel=0)        # every slot holds its block
                recv.copy_(peer)              # copy engine reads the previous rank's slot
                hdl.barrier(channel=1)        # every pull is done before any slot changes
        return go

    # Copy-engine pull ordered by CUDA IPC events (no kernel of ours on the SMs): 'ready' is recorded
    # once my slot holds its block; the next rank waits for it on its side stream, copies, records
    # 'pulled'; a host barrier on a gloo group makes each wait follow the matching record.
    ctrl = dist.new_group(backend="gloo")
    ready, pulled = torch.cuda.Event(interprocess=True), torch.cuda.Event(interprocess=True)
    handles = [None] * world
    dist.all_gather_object(handles, (ready.ipc_handle(), pulled.ipc_handle()), group=ctrl)
    peer_ready = torch.cuda.Event.from_ipc_handle(dev, handles[prv][0])
    next_pulled = torch.cuda.Event.from_ipc_handle(dev, handles[nxt][1])
    pulled.record(torch.cuda.current_stream())
    torch.cuda.synchronize(dev)
    dist.barrier(group=ctrl)

    def pull_ipc(stream):
        def go():
            main = torch.cuda.current_stream()
            main.wait_event(next_pulled)      # my slot may change only after the next rank read it
            ready.record(main)                # (the slot's contents are fixed in this experiment)
            dist.barrier(group=ctrl)          # every 'ready' is recorded before anyone waits on it
            with torch.cuda.stream(stream):
                stream.wait_event(peer_ready)
                recv.copy_(peer)
                pulled.record(stream)
            dist.barrier(group=ctrl)          # every 'pulled' is recorded before the next wait on it
        return go

    variants = {"nccl, normal-priority stream": nccl(normal), "nccl, high-priority stream": nccl(high),
                "symm-mem pull + device barriers, normal": pull(normal),
                "symm-mem pull + device barriers, high": pull(high),
                "copy-engine pull + IPC events": pull_ipc(high)}
    for _ in range(3):
        compute()
    t_compute = timed(compute, dev)
    rows = []
    for name, exchange in variants.items():
        exchange()
        t_ex = timed(exchange, dev)
        main = torch.cuda.current_stream()

        def both():
            if "IPC" in name:
                compute()                  # queued first: the host barrier inside must not idle the GPU
                exchange()
            else:
                exchange()                 # issued first, on its side stream
                compute()
            main.wait_stream(high)
            main.wait_stream(normal)
        t_both = timed(both, dev)
        hidden = (t_compute + t_ex - t_both) / t_ex
        rows.append((name, t_compute * 1e3, t_ex * 1e3, t_both * 1e3, hidden))
    expected = torch.empty_like(kv)
    dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt), dist.P2POp(dist.irecv, expected, prv)])[0].wait()
    pull(high)()
    torch.cuda.synchronize(dev)
    correct = torch.equal(recv, expected)
    recv.zero_()
    pull_ipc(high)()
    torch.cuda.synchronize(dev)
    correct = correct and torch.equal(recv, expected)
    if rank == 0:
        print(f"world {world}; block 64 MiB; both pulls deliver the same bytes as NCCL: {correct}")
        print("| exchange | compute ms | exchange ms | together ms | hidden |")
        print("|---|---|---|---|---|")
        for name, c, e, b, h in rows:
            print(f"| {name} | {c:.2f} | {e:.2f} | {b:.2f} | {h:.0%} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    world = torch.cuda.device_count()
    mp.spawn(rank_main, args=(world, port), nprocs=world)

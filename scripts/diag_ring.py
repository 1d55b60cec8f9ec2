"""Diagnostic: the NCCL ring on 2 GPUs; received blocks and outputs vs fp32 reference, per variant."""
import os
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, world, port):
    from engine.burst_attention import BurstAttention
    from engine.ring import RingCommunicator
    from engine.sharding import zigzag_shards
    from kernels.attention import select_backend, reference_attention
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev)
    ring = RingCommunicator(rank, world, dev)
    # raw exchange check
    send = torch.full((1000, 2, 8, 128), float(rank + 1), device=dev, dtype=torch.bfloat16)
    recv = torch.empty_like(send)
    h = ring.exchange(send, recv)
    ring.wait(h)
    print(rank, "raw exchange got", recv.float().mean().item(), "expected", float((rank - 1) % world + 1), flush=True)
    backend = select_backend(dev, torch.bfloat16, 32, 8, 128)
    for n in (4099, 16384):
        gen = torch.Generator(device=dev).manual_seed(1234)
        q = torch.randn(n, 32, 128, device=dev, dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(n, 2, 8, 128, device=dev, dtype=torch.bfloat16, generator=gen)
        shards = zigzag_shards(n, world)
        pos = shards[rank].positions(dev)
        ref_o, ref_l = reference_attention(q[pos], kv[:, 0], kv[:, 1], False, 128 ** -0.5) if False else (None, None)
        # causal reference by positions
        qf = q[pos].float()
        full_o, full_l = reference_attention(q, kv[:, 0], kv[:, 1], True, 128 ** -0.5, query_chunk=512)
        for name, kwargs in (("overlap", dict(overlap=True)), ("no-overlap", dict(overlap=False))):
            for be_name, be in (("auto", backend), ("reference", None)):
                from kernels.attention import AttentionBackend
                b = be or AttentionBackend("reference", reference_attention)
                out, lse = BurstAttention(ring, b, shards, rank, 128 ** -0.5, **kwargs).forward(q[pos], kv[pos].contiguous())
                torch.cuda.synchronize()
                print(rank, n, name, be_name, "out_err", round((out.float() - full_o[pos].float()).abs().max().item(), 4),
                      "lse_err", round((lse - full_l[pos]).abs().max().item(), 5), flush=True)
    ring.collect_stats()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(rank_main, args=(2, port), nprocs=2)

"""Host time per call of what one layer of an incremental prefill launches on a worker, one GPU.

A small chunk's extend is bound by the host (a 256-token chunk: ~370 kernels for 32 layers on one
worker, docs/benchmarks.md), so the cost of a way is roughly the host time of the calls it makes per
layer. This measures each call alone: `host us` is the time to issue one call (mean over a loop, no
synchronization inside: what the Python thread spends), `wall us` the time per call with the GPU's
work included (the loop then one synchronize). llama3-8b shapes, bf16; a 256-token chunk after 2048
cached tokens; collectives on a one-rank NCCL group (their host side; no peer to wait for). Then the
two multi-worker ways' layers as the sums of their calls (engine/extend_attention.py).

    python scripts/gpu_host_costs.py            # on a GPU machine, flash-attn-4 installed
"""
import os
import time

import torch
import torch.distributed as dist

from engine.decode_attention import all_gather, all_gather_rows, merge_over_workers
from engine.parallel.ring import RingCommunicator
from kernels import fused
from kernels.attention import select_backend
from kernels.merge import merge_into, merge_stacked
from kernels.paged_attention import guarded_table, merge_partials, paged_attention

H, HKV, D, HIDDEN = 32, 8, 128, 4096
N, CACHED, BS = 256, 2048, 128
CALLS = 200


def timed(fn, calls: int = CALLS) -> tuple[float, float]:
    """-> (host us per call, wall us per call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    end = time.perf_counter()
    return (issued - start) / calls * 1e6, (end - start) / calls * 1e6


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    dev, dt = torch.device("cuda:0"), torch.bfloat16
    torch.cuda.set_device(dev)
    backend = select_backend(dev, dt, H, HKV, D)
    q = torch.randn(N, H, D, device=dev, dtype=dt)
    k, v = (torch.randn(N, HKV, D, device=dev, dtype=dt) for _ in range(2))
    pages = (CACHED + N) // BS
    k_cache, v_cache = (torch.randn(pages + 1, BS, HKV, D, device=dev, dtype=dt) for _ in range(2))
    table = guarded_table(torch.arange(1, pages + 1, dtype=torch.int32, device=dev)[None])
    cu = torch.tensor([0, N], dtype=torch.int32, device=dev)
    keys_all = torch.tensor([CACHED + N], dtype=torch.int32, device=dev)
    keys_cached = torch.tensor([CACHED], dtype=torch.int32, device=dev)
    out32 = torch.randn(N, H, D, device=dev)
    lse32 = torch.randn(N, H, device=dev)
    x = torch.randn(N, HIDDEN, device=dev, dtype=dt)
    w_qkv = torch.randn((H + 2 * HKV) * D, HIDDEN, device=dev, dtype=dt)
    norm = torch.randn(HIDDEN, device=dev, dtype=dt)
    qkv = torch.nn.functional.linear(x, w_qkv)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=dev).float() / D))
    freqs = torch.outer(torch.arange(N, device=dev).float(), inv)
    cos, sin = torch.cat([freqs.cos()] * 2, -1).to(dt), torch.cat([freqs.sin()] * 2, -1).to(dt)
    slots = torch.arange(BS, BS + N, device=dev)
    packed = torch.randn(N, H, D + 1, device=dev)
    gathered = torch.randn(2, N, H, D + 1, device=dev)
    recv = torch.empty_like(packed)
    ring = RingCommunicator(0, 1, dev)                       # exchanges with itself: host side of one step
    send_kv, recv_kv = torch.randn(N // 2, 2, HKV, D, device=dev, dtype=dt), torch.empty(N // 2, 2, HKV, D, device=dev, dtype=dt)

    def exchange():
        ring.wait(ring.exchange(send_kv, recv_kv))

    rows = {
        "tiny eager op (x.add_)": lambda: lse32.add_(0.0),
        "qkv GEMM [256 x 4096 x 6144]": lambda: torch.nn.functional.linear(x, w_qkv),
        "fused rms_norm": lambda: fused.rms_norm(x, norm, 1e-5),
        "fused rope_ (in place)": lambda: fused.rope_(qkv, cos, sin, H, HKV),
        "pages write (K and V)": lambda: fused.store_kv(k_cache, v_cache, slots, k, v),
        "dense causal 256 x 256 (ring own block)": lambda: backend(q, k, v, True, 0.1),
        "dense full 128 x 128 (ring other block)": lambda: backend(q[N // 2:], k[:N // 2], v[:N // 2], False, 0.1),
        "paged causal 256 after 2048 (local/whole keeper)":
            lambda: paged_attention(q, k_cache, v_cache, table, cu, keys_all, 0.1, causal=True, rows_see_keys=True),
        "paged unmasked 256 vs 2048 (whole other / pass-Q)":
            lambda: paged_attention(q, k_cache, v_cache, table, cu, keys_cached, 0.1, causal=False, rows_see_keys=True),
        "merge_into (ring step merge)": lambda: merge_into(out32, lse32, q.float(), lse32),
        "merge_stacked of 3": lambda: merge_stacked(torch.stack([out32] * 3), torch.stack([lse32] * 3)),
        "ring exchange + wait (events, P2P to self)": exchange,
        "all_gather_into_tensor (1 rank)": lambda: all_gather(packed, 1),
        "all_gather rows, padded list (pass-Q)": lambda: all_gather_rows(q, [N], None),
        "all_to_all_single (1 rank)": lambda: dist.all_to_all_single(recv, packed, [N], [N]),
        "merge of 2 partials: torch merge_stacked (before)": lambda: merge_stacked(gathered[..., :-1], gathered[..., -1]),
        "merge of 2 partials: Triton merge_partials": lambda: merge_partials(gathered[..., :-1], gathered[..., -1], dt),
        "merge_over_workers (cat, all-gather, merge)": lambda: merge_over_workers(q, lse32, 1),
    }
    results = {}
    print("| call | host us | wall us |\n|---|---|---|")
    for name, fn in rows.items():
        try:
            host, wall = timed(fn)
        except Exception as e:                               # e.g. P2P to self refused: said, not fatal
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:80]} | |")
            continue
        results[name] = host
        print(f"| {name} | {host:.1f} | {wall:.1f} |")

    def total(parts):
        return sum(results.get(p, float("nan")) * c for p, c in parts)

    whole = [("pages write (K and V)", 1), ("paged causal 256 after 2048 (local/whole keeper)", 1),
             ("merge_over_workers (cat, all-gather, merge)", 1), ("tiny eager op (x.add_)", 1)]
    ring_layer = [("ring exchange + wait (events, P2P to self)", 1), ("dense causal 256 x 256 (ring own block)", 1),
                  ("dense full 128 x 128 (ring other block)", 1), ("merge_into (ring step merge)", 1),
                  ("all_gather rows, padded list (pass-Q)", 1), ("paged unmasked 256 vs 2048 (whole other / pass-Q)", 1),
                  ("all_to_all_single (1 rank)", 1), ("tiny eager op (x.add_)", 8),
                  ("merge_stacked of 3", 1), ("pages write (K and V)", 1)]
    print(f"\nattention's host time per layer, 2 workers (sums of the calls above): whole {total(whole):.0f} us, "
          f"ring {total(ring_layer):.0f} us; x 32 layers: whole {total(whole) * 32 / 1e3:.1f} ms, "
          f"ring {total(ring_layer) * 32 / 1e3:.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

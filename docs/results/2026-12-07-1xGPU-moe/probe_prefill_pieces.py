"""A prefill piece through one Qwen3-30B-A3B layer's experts (128 experts, top 8, 2048 -> 768 -> 2048, bf16) on one
GPU, stage by stage: the router, the sort, the gather, the two grouped GEMMs, silu*up, the combine; the whole
grouped_experts of the tree against the one before it (weighted sum after down, fp32 products) and the bare GEMMs.
python3 docs/results/2026-12-07-1xGPU-moe/probe_prefill_pieces.py"""
import torch

from burstserve.engine.model.moe import ExpertWeights, grouped_experts, route
from burstserve.kernels import fused

E, K, HID, INTER = 128, 8, 2048, 768
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
w = ExpertWeights(router=torch.randn(E, HID, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
                  gate_up=torch.randn(E, 2 * INTER, HID, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
                  down=torch.randn(E, HID, INTER, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
                  top_k=K, renormalize=True, weights_fp32=False)


def timed(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3     # us


def before(x, experts, weights, chosen):
    """grouped_experts as it was (tree 58af417): y scattered back by choice, times the weights, summed."""
    n, top_k = chosen.shape
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.to(torch.int32), torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    routed = x[order // top_k]
    up = torch._grouped_mm(routed, experts.gate_up.transpose(-2, -1), offs=offsets)
    y = torch._grouped_mm(fused.silu_and_mul(up), experts.down.transpose(-2, -1), offs=offsets)
    by_choice = torch.empty_like(y)
    by_choice[order] = y
    return (by_choice.view(n, top_k, -1) * weights[..., None]).sum(dim=1).to(x.dtype)


print("| rows | stage | us |")
print("|---|---|---|")
for n in (4096, 16384):
    x = torch.randn(n, HID, device=dev, dtype=torch.bfloat16, generator=g)
    weights, chosen = route(x, w)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=dev)
    counts.scatter_add_(0, flat.to(torch.int32), torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    routed = x[order // K]
    up = torch._grouped_mm(routed, w.gate_up.transpose(-2, -1), offs=offsets)
    act = fused.silu_and_mul(up)
    y = torch._grouped_mm(act, w.down.transpose(-2, -1), offs=offsets)
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel(), device=dev)

    def sort_stage():
        o = torch.argsort(flat, stable=True)
        c = torch.zeros(E, dtype=torch.int32, device=dev)
        c.scatter_add_(0, flat.to(torch.int32), torch.ones_like(flat, dtype=torch.int32))
        torch.cumsum(c, 0, dtype=torch.int32)
        return o

    def scaled():
        a = fused.silu_and_mul(up)
        a.mul_(weights.flatten()[order, None].to(a.dtype))

    stages = {
        "route (router GEMM, softmax, top-k)": lambda: route(x, w),
        "sort (argsort, counts, offsets)": sort_stage,
        "gather x rows": lambda: x[order // K],
        "grouped GEMM gate/up": lambda: torch._grouped_mm(routed, w.gate_up.transpose(-2, -1), offs=offsets),
        "silu*up": lambda: fused.silu_and_mul(up),
        "silu*up, times the weights": scaled,
        "grouped GEMM down": lambda: torch._grouped_mm(act, w.down.transpose(-2, -1), offs=offsets),
        "combine before (scatter, fp32 product, sum)": lambda: (lambda b: (b.__setitem__(order, y), (b.view(n, K, -1) * weights[..., None]).sum(1).to(x.dtype)))(torch.empty_like(y)),
        "combine now (slot index, gather, sum)": lambda: y[slot].view(n, K, -1).sum(1),
        "grouped_experts before": lambda: before(x, w, weights, chosen),
        "grouped_experts now": lambda: grouped_experts(x, w, weights, chosen),
    }
    for name, fn in stages.items():
        print(f"| {n} | {name} | {timed(fn):.0f} |")
    bare = timed(lambda: (torch._grouped_mm(routed, w.gate_up.transpose(-2, -1), offs=offsets),
                          torch._grouped_mm(act, w.down.transpose(-2, -1), offs=offsets)))
    print(f"| {n} | the two grouped GEMMs alone | {bare:.0f} |")
    a, b = before(x, w, weights, chosen).float(), grouped_experts(x, w, weights, chosen).float()
    print(f"| {n} | max abs(now - before) / max abs(before) | {((a - b).abs().max() / a.abs().max()).item():.2e} |")

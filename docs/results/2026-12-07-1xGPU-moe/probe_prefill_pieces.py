"""A prefill piece through one Qwen3-30B-A3B layer's experts (128 experts, top 8, 2048 -> 768 -> 2048, bf16) on one
GPU, stage by stage: the router, the sort, the gather, the two grouped GEMMs, silu*up, the combine; the whole
grouped_experts of the tree against the one before it (weighted sum after down, fp32 products) and the bare GEMMs.
python3 docs/results/2026-12-07-1xGPU-moe/probe_prefill_pieces.py"""
import torch
import triton
import triton.language as tl

from burstserve.engine.model.moe import ExpertWeights, grouped_experts, route
from burstserve.kernels import fused

E, K, HID, INTER = 128, 8, 2048, 768
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
w = ExpertWeights(router=torch.randn(E, HID, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
                  gate_up=torch.randn(E, 2 * INTER, HID, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
                  down=torch.randn(E, HID, INTER, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
                  top_k=K, renormalize=True, weights_fp32=False)


@triton.jit
def _sum_choices_kernel(y, slot, out, hidden, K: tl.constexpr, BLOCK: tl.constexpr):
    """candidate: out[r, block] = sum_j y[slot[r K + j], block], fp32 sums, one rounding; y read once."""
    r, b = tl.program_id(0), tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(K):
        s = tl.load(slot + r * K + j).to(tl.int64)
        acc += tl.load(y + s * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + r.to(tl.int64) * hidden + cols, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_scale_kernel(up, w, act, inter, BLOCK: tl.constexpr):
    """candidate: act[r] = silu(gate[r]) * up[r] * w[r] in fp32, one rounding."""
    r, b = tl.program_id(0), tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    base = up + r.to(tl.int64) * 2 * inter
    g = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + inter + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(w + r).to(tl.float32)
    tl.store(act + r.to(tl.int64) * inter + cols, (g / (1 + tl.exp(-g)) * u * s).to(act.dtype.element_ty), mask=mask)


def sum_choices_triton(y, slot, n, k):
    out = torch.empty(n, y.shape[1], dtype=y.dtype, device=y.device)
    _sum_choices_kernel[(n, triton.cdiv(y.shape[1], 1024))](y, slot, out, y.shape[1], K=k, BLOCK=1024)
    return out


def silu_mul_scale_triton(up, w):
    inter = up.shape[1] // 2
    act = torch.empty(up.shape[0], inter, dtype=up.dtype, device=up.device)
    _silu_mul_scale_kernel[(up.shape[0], triton.cdiv(inter, 1024))](up, w, act, inter, BLOCK=1024)
    return act


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
        "sort, int32 keys": lambda: torch.argsort(flat.to(torch.int32), stable=True),
        "gather x rows, index_select": lambda: torch.index_select(x, 0, order // K),
        "silu*up times the weights, one Triton kernel": lambda: silu_mul_scale_triton(up, weights.flatten()[order]),
        "combine, index_select, sum": lambda: y.index_select(0, slot).view(n, K, -1).sum(1),
        "combine, one Triton kernel": lambda: sum_choices_triton(y, slot, n, K),
        "grouped_experts before": lambda: before(x, w, weights, chosen),
        "grouped_experts now": lambda: grouped_experts(x, w, weights, chosen),
    }
    for name, fn in stages.items():
        print(f"| {n} | {name} | {timed(fn):.0f} |")
    bare = timed(lambda: (torch._grouped_mm(routed, w.gate_up.transpose(-2, -1), offs=offsets),
                          torch._grouped_mm(act, w.down.transpose(-2, -1), offs=offsets)))
    print(f"| {n} | the two grouped GEMMs alone | {bare:.0f} |")
    ref = y[slot].view(n, K, -1).sum(1)
    print(f"| {n} | Triton combine == gather+sum (bits) | {torch.equal(ref, sum_choices_triton(y, slot, n, K))} |")
    a, b = before(x, w, weights, chosen).float(), grouped_experts(x, w, weights, chosen).float()
    print(f"| {n} | max abs(now - before) / max abs(before) | {((a - b).abs().max() / a.abs().max()).item():.2e} |")

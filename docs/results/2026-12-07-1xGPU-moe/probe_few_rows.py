"""The few-rows experts' kernels (burstserve/kernels/moe_few_rows.py) against torch's grouped GEMMs
(engine/moe.grouped_experts) on one GPU, bf16, both replayed from CUDA graphs: Qwen3-30B-A3B's layer (128 experts,
top 8, 2048 -> 768 -> 2048) at 1, 4, 16 and 64 rows, Mixtral-8x7B's (8 experts, top 2, 4096 -> 14336 -> 4096) at 1
and 16, beside the floor: the bytes of the experts the rows chose at the rate of a bare device copy measured in the
same run. Routing (a random router's softmax top-k) is done before the timed calls: both paths take the same
weights and choices. A graph runs LAYERS copies of the layer one after the other, each with its own weights and
router, so that a replay reads weights no longer in L2 (as a decode step's layers do); times are per layer.
Values: the few-rows output against grouped_experts' (max |diff| / max |grouped|), and the graph's replay against
the eager call (the same bits). Extra rows time other launch settings (block_k, stages, warps, waves).
python docs/results/2026-12-07-1xGPU-moe/probe_few_rows.py"""
import os
import sys
import traceback

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))   # the tree's root
from burstserve.engine.model.moe import ExpertWeights, grouped_experts, route
from burstserve.kernels import moe_few_rows as mf

dev = torch.device("cuda")
bf = torch.bfloat16
MODELS = [  # name, experts, top k, hidden, Im, router weights fp32, copies of the layer, row counts
    ("qwen3-30b-a3b", 128, 8, 2048, 768, False, 4, (1, 4, 16, 64)),
    ("mixtral-8x7b", 8, 2, 4096, 14336, True, 2, (1, 16)),
]
VARIANTS = [dict(), dict(block_k=64), dict(block_k=256, stages=2), dict(stages=4), dict(warps=8), dict(waves=1),
            dict(waves=4)]
ITERS = 20


def copy_rate() -> float:
    """Bytes a second of a bare device-to-device copy of 2 GiB (read + written)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        dst.copy_(src)
    b.record()
    torch.cuda.synchronize()
    rate = 2 * src.numel() * 5 / (a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return rate


def make_layers(e, k, hid, im, fp32_weights, copies, g) -> list[ExpertWeights]:
    return [ExpertWeights(router=torch.randn(e, hid, device=dev, dtype=bf, generator=g) * 0.02,
                          gate_up=torch.randn(e, 2 * im, hid, device=dev, dtype=bf, generator=g) * 0.02,
                          down=torch.randn(e, hid, im, device=dev, dtype=bf, generator=g) * 0.02,
                          top_k=k, renormalize=True, weights_fp32=fp32_weights) for _ in range(copies)]


def graph_us(fn) -> tuple[float, list[torch.Tensor]]:
    """fn() -> list of outputs, captured in a CUDA graph: (us a replay, averaged over ITERS; the graph's outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()                                         # compiles, and warms the allocator off the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(ITERS):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / ITERS * 1e3, outs


def row(kern, name, layers, x, routes, rate, launch) -> str:
    """One table row: the few-rows kernels with `launch` on rows x [m, hidden] routed by routes (a (weights, chosen)
    a layer), and for the default launch grouped_experts too."""
    m, hid = x.shape
    im = layers[0].down.shape[2]
    unique = sum(chosen.unique().numel() for _, chosen in routes) / len(layers)
    floor = unique * 3 * im * hid * 2 / rate * 1e6                                 # us a layer
    few_fn = lambda: [mf._launch(kern, x, w.gate_up, w.down, *r, **launch) for w, r in zip(layers, routes)]
    eager = few_fn()
    if any(out is None for out in eager):
        return f"| {name} | {m} | {launch or 'default'} | {unique:.1f} | None: the kernels do not take these shapes |"
    few, replayed = graph_us(few_fn)
    few /= len(layers)
    same = all(torch.equal(a, b) for a, b in zip(eager, replayed))
    grouped, diff = float("nan"), "-"
    if not launch:
        grouped_fn = lambda: [grouped_experts(x, w, *r) for w, r in zip(layers, routes)]
        try:
            want = grouped_fn()
            rel = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(eager, want))
            diff = f"{rel:.2e}"
            grouped = graph_us(grouped_fn)[0] / len(layers)
        except Exception as err:
            diff = f"grouped_experts failed: {type(err).__name__}"
            traceback.print_exc()
    gbs = unique * 3 * im * hid * 2 / few / 1e3
    return (f"| {name} | {m} | {launch or 'default'} | {unique:.1f} | {few:.1f} | {grouped:.1f} | {floor:.1f} | "
            f"{gbs:.0f} | {floor / few:.2f} | {diff} | {same} |")


def main():
    print(f"GPU: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}")
    rate = copy_rate()
    print(f"device copy: {rate / 1e12:.2f} TB/s (the floor's rate)\n")
    kern = mf._triton.kernels(dev)
    if kern is None:
        print("no Triton kernels (see the log line above)")
        return
    print("| model | rows | launch | experts chosen a layer | few-rows us | grouped GEMMs us | floor us | "
          "few-rows GB/s | floor / few-rows | max diff / max (vs grouped) | replay == eager |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device=dev).manual_seed(0)
    for name, e, k, hid, im, fp32_weights, copies, rows in MODELS:
        try:
            layers = make_layers(e, k, hid, im, fp32_weights, copies, g)
        except Exception as err:
            print(f"| {name} | | | error making the layers: {type(err).__name__}: {err} |")
            continue
        for m in rows:
            try:
                x = torch.randn(m, hid, device=dev, dtype=bf, generator=g)
                routes = [route(x, w) for w in layers]                 # the same rows and choices for each launch
            except Exception as err:
                print(f"| {name} | {m} | | error routing: {type(err).__name__}: {err} |")
                continue
            for launch in VARIANTS:
                try:
                    print(row(kern, name, layers, x, routes, rate, launch), flush=True)
                except Exception as err:
                    print(f"| {name} | {m} | {launch or 'default'} | error: {type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''} |", flush=True)
                    traceback.print_exc()
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

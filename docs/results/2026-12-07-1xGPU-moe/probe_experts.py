"""The experts' MLP of one Qwen3-30B-A3B layer (128 experts, top 8, 2048 -> 768 -> 2048, bf16) on one GPU: eager and
replayed from a CUDA graph, by rows, against the bytes of the experts the rows chose (the decode floor) and the FLOPs.
python3 docs/results/2026-12-07-1xGPU-moe/probe_experts.py"""
import torch

from burstserve.engine.model.moe import ExpertWeights, experts_mlp, route

E, K, HID, INTER = 128, 8, 2048, 768
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
w = ExpertWeights(router=torch.randn(E, HID, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
                  gate_up=torch.randn(E, 2 * INTER, HID, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
                  down=torch.randn(E, HID, INTER, device=dev, dtype=torch.bfloat16, generator=g) * 0.02,
                  top_k=K, renormalize=True, weights_fp32=False)


def timed(fn, iters=50):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3     # us


print("| rows | experts chosen | eager us | graph us | chosen experts' bytes / graph time GB/s | TFLOP/s |")
print("|---|---|---|---|---|---|")
for n in (1, 4, 16, 64, 1024, 16384):
    x = torch.randn(n, HID, device=dev, dtype=torch.bfloat16, generator=g)
    chosen = route(x, w)[1].unique().numel()
    eager = timed(lambda: experts_mlp(x, w))
    graph_us = float("nan")
    if n <= 1024:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            experts_mlp(x, w)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            experts_mlp(x, w)
        graph_us = timed(graph.replay)
    best = min(eager, graph_us) if graph_us == graph_us else eager
    nbytes = chosen * 3 * INTER * HID * 2
    flops = 2 * n * K * 3 * INTER * HID
    print(f"| {n} | {chosen} | {eager:.1f} | {graph_us:.1f} | {nbytes / best / 1e3:.0f} | {flops / best / 1e6:.1f} |")

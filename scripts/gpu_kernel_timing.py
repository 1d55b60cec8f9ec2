"""kernels/ timed on one GPU, llama3-8b shapes (32 q heads, 8 KV heads, d 128, bf16): the ring blocks
(kernels.attention's flash_attn_4 and cudnn backends, TFLOP/s), then paged decode, one layer, page 128
(flash-attn-4 through kernels.paged_attention under CUDA graph replay against the dense fallback), then
a num_chunks sweep of the decode fast path. Needs flash-attn-4 (scripts/README.md, "Device calls").

    [HKV=8] python scripts/gpu_kernel_timing.py [--no-blocks]     (markdown tables; --no-blocks: the paged tables only)

HKV sets the KV heads (4: Qwen3-30B-A3B's, whose decode splits a sequence into twice the chunks at the same SMs).

`bash scripts/gpu.sh kernels` runs it after the kernel GPU tests; `bash scripts/gpu.sh decode` runs it
with --no-blocks. Its CUDA-event timers are imported by the other GPU tools (`timed`: gpu_host_tier.py,
gpu_fa3_fp8.py; `graph_us`: gpu_fp8_decode.py)."""
import os
import sys

import torch

import burstserve.kernels.paged_attention as pa
from burstserve.kernels import merge
from burstserve.kernels.attention import AttentionBackend, _GPU_BACKENDS
from burstserve.kernels.paged_attention import choose_num_chunks, paged_attention

dev, bf = torch.device("cuda:0"), torch.bfloat16
H, D, PAGE = 32, 128, 128                   # llama3-8b shapes
HKV = int(os.environ.get("HKV", "8"))


def time_us(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); a.record()
    for _ in range(iters):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / iters


def timed(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median seconds of fn() on the current stream, each call between two CUDA events (after `warmup` calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def graph_us(f, iters=50):
    """Capture f in a CUDA graph after two eager warm-up calls; replay time in us, and f's outputs."""
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f(); f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = f()
    us = time_us(g.replay, iters=iters)
    g.replay(); torch.cuda.synchronize()
    return us, res


def decode_case(b, ctx):
    pages = ctx // PAGE
    kc = torch.randn(b * pages, PAGE, HKV, D, device=dev, dtype=bf)
    vc = torch.randn(b * pages, PAGE, HKV, D, device=dev, dtype=bf)
    table = torch.randperm(b * pages, device=dev).to(torch.int32).view(b, pages)
    cu = torch.arange(b + 1, device=dev, dtype=torch.int32)
    lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(b, H, D, device=dev, dtype=bf)
    return q, kc, vc, table, cu, lens


def fa4(case, chunks, **kw):
    return lambda: paged_attention(*case, D ** -0.5, True, backend="fa4", num_chunks=chunks, **kw)


def ring_blocks():
    print("\nring blocks (kernels.attention backends), TFLOP/s")
    print("| block | flash_attn_4 | cudnn |\n| --- | --- | --- |")
    for sq, sk, causal in ((4096, 4096, True), (8192, 8192, True), (32768, 32768, True), (65536, 65536, True),
                           (32768, 32768, False), (65536, 65536, False)):
        q = torch.randn(sq, H, D, device=dev, dtype=bf)
        kv = torch.randn(sk, 2, HKV, D, device=dev, dtype=bf)
        flops = 4 * sq * sk * H * D * (0.5 if causal else 1.0)
        row = []
        for name in ("flash_attn_4", "cudnn"):
            be = AttentionBackend(name, _GPU_BACKENDS[name])
            us = time_us(lambda: be(q, kv[:, 0], kv[:, 1], causal, D ** -0.5), iters=10 if sq > 8192 else 20)
            row.append(f"{flops / us / 1e6:.0f}")
        label = f"{sq // 1024}K causal" if causal else f"{sq // 1024}K x {sk // 1024}K full"
        print(f"| {label} | {row[0]} | {row[1]} |", flush=True)
        del q, kv


def paged_decode():
    print("\npaged decode, one layer, page 128, microseconds (fa4: CUDA graph replay; dense: eager gather + best dense)")
    print("decode = the fast path (max_seqlen_q=1; split: Triton chunk-length + merge kernels), generic = no")
    print("max_seqlen_q (row lookup; the path measured before)")
    print("| batch x context | fa4 decode (chunks) | fa4 generic | fa4 no split | dense fallback | KV TB/s (fa4 decode) |")
    print("| --- | --- | --- | --- | --- | --- |")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for b, ctx in ((1, 8192), (1, 32768), (1, 131072), (16, 8192), (64, 2048)):
        case = decode_case(b, ctx)
        res = []
        us, (out, _) = graph_us(fa4(case, None, max_seqlen_q=1)); res.append(us)
        ref, _ = paged_attention(*case, D ** -0.5, True, backend="dense")
        err = (out.float() - ref.float()).abs().max().item()
        res.append(graph_us(fa4(case, None))[0])
        res.append(graph_us(fa4(case, 1, max_seqlen_q=1))[0])
        res.append(time_us(lambda: paged_attention(*case, D ** -0.5, True, backend="dense"), iters=10))
        nch = choose_num_chunks(b, HKV, ctx, sms)
        tbs = 2 * b * ctx * HKV * D * 2 / (res[0] * 1e-6) / 1e12
        print(f"| {b} x {ctx // 1024}K | {res[0]:.0f} ({nch} chunk{'s' if nch > 1 else ''}) | {res[1]:.0f} | {res[2]:.0f} "
              f"| {res[3]:.0f} | {tbs:.2f} |  max|fa4-dense| {err:.1e}", flush=True)
        del case, out, ref

    print("\nnum_chunks sweep, decode fast path (max_seqlen_q=1, Triton merge), CUDA graph replay, microseconds")
    sweep = (4, 8, 12, 16, 24, 32, 48, 64)
    print("| batch x context | " + " | ".join(f"{c} chunks" for c in sweep) + " |")
    print("| --- | " + " | ".join("---" for _ in sweep) + " |")
    for b, ctx in ((1, 8192), (1, 32768), (1, 131072)):
        case = decode_case(b, ctx)
        row = [graph_us(fa4(case, c, max_seqlen_q=1))[0] for c in sweep]
        print(f"| {b} x {ctx // 1024}K (auto {choose_num_chunks(b, HKV, ctx, sms)}) | "
              + " | ".join(f"{us:.0f}" for us in row) + " |", flush=True)
        del case
    # False: a Triton kernel failed (logged) and torch ran instead
    print("Triton split kernels on at the end:", pa._triton.enabled and merge._triton.enabled)


def main() -> None:
    print(f"device: {torch.cuda.get_device_name(dev)}; {H} q heads, {HKV} kv heads, d {D}, bf16")
    if "--no-blocks" not in sys.argv[1:]:
        ring_blocks()
    paged_decode()


if __name__ == "__main__":
    main()

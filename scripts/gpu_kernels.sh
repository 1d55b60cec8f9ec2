#!/usr/bin/env bash
# kernels/ on one GPU (H100 or H200): the flash-attn-4 backend and paged_attention checked
# (tests/gpu/test_kernels_gpu.py), then a timing table. Two back-to-back device calls, as
# ../shared/gpu/README.md says (after ../shared/gpu/prepare.sh and ../shared/gpu/fa4-prepare.sh here):
#   1. carry [".fa4a"]:          mkdir -p /tmp/fa4 && cp .fa4a/part.aa /tmp/fa4/
#   2. carry [".fa4b", ".whl"]:  bash scripts/gpu_kernels.sh      (within ~30 s of the first)
# Everything lands in $OUT/gpu_kernels.tgz (pytest log, timing table).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_kernels_out}
log=/tmp/gpu_kernels; rm -rf "$log"; mkdir -p "$log" "$OUT"
pack() { tar czf "$OUT/gpu_kernels.tgz" -C /tmp gpu_kernels; }
trap pack EXIT
bash .fa4b/install.sh || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD PYTHONUNBUFFERED=1
{ date -u; nvidia-smi -L; python3 -c "import torch, flash_attn.cute as c; print('torch', torch.__version__, 'flash_attn.cute', c.__version__)"; } 2>&1 | tee "$log/env.txt"

# SKIP_TESTS=1 SKIP_BLOCKS=1: only the paged decode tables (scripts/gpu_decode.sh runs it so)
[ -n "${SKIP_TESTS:-}" ] || timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py 2>&1 | tee "$log/pytest.log"

timeout 200 python3 - <<'EOF' 2>&1 | tee "$log/timing.txt"
import torch
from kernels.attention import AttentionBackend, _GPU_BACKENDS
from kernels.paged_attention import choose_num_chunks, paged_attention

dev, bf = torch.device("cuda:0"), torch.bfloat16
H, HKV, D, PAGE = 32, 8, 128, 128            # llama3-8b shapes

def time_us(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); a.record()
    for _ in range(iters):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / iters

print(f"device: {torch.cuda.get_device_name(dev)}; llama3-8b shapes ({H} q heads, {HKV} kv heads, d {D}, bf16)")
print("\nring blocks (kernels.attention backends), TFLOP/s")
print(f"| block | flash_attn_4 | cudnn |\n| --- | --- | --- |")
import os
BLOCKS = () if os.environ.get("SKIP_BLOCKS") else ((4096, 4096, True), (8192, 8192, True), (32768, 32768, True), (65536, 65536, True), (32768, 32768, False), (65536, 65536, False))
for sq, sk, causal in BLOCKS:
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

import kernels.paged_attention as pa

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

print("\npaged decode, one layer, page 128, microseconds (fa4: CUDA graph replay; dense: eager gather + best dense)")
print("decode = the fast path (max_seqlen_q=1; split: Triton chunk-length + merge kernels), torch merge = its")
print("fallback without Triton, generic = no max_seqlen_q (row lookup; the path measured before)")
print("| batch x context | fa4 decode (chunks) | fa4 decode, torch merge | fa4 generic | fa4 no split | dense fallback | KV TB/s (fa4 decode) |")
print("| --- | --- | --- | --- | --- | --- | --- |")
sms = torch.cuda.get_device_properties(dev).multi_processor_count
for b, ctx in ((1, 8192), (1, 32768), (1, 131072), (16, 8192), (64, 2048)):
    case = decode_case(b, ctx)
    res = []
    us, (out, _) = graph_us(fa4(case, None, max_seqlen_q=1)); res.append(us)
    ref, _ = paged_attention(*case, D ** -0.5, True, backend="dense")
    err = (out.float() - ref.float()).abs().max().item()
    tri = pa._SPLIT_TRITON                      # False here: Triton failed (logged) and the column above is torch
    pa._SPLIT_TRITON = False
    res.append(graph_us(fa4(case, None, max_seqlen_q=1))[0])
    pa._SPLIT_TRITON = tri
    res.append(graph_us(fa4(case, None))[0])
    res.append(graph_us(fa4(case, 1, max_seqlen_q=1))[0])
    res.append(time_us(lambda: paged_attention(*case, D ** -0.5, True, backend="dense"), iters=10))
    nch = choose_num_chunks(b, HKV, ctx, sms)
    tbs = 2 * b * ctx * HKV * D * 2 / (res[0] * 1e-6) / 1e12
    print(f"| {b} x {ctx // 1024}K | {res[0]:.0f} ({nch} chunk{'s' if nch > 1 else ''}) | {res[1]:.0f} | {res[2]:.0f} | {res[3]:.0f} | {res[4]:.0f} | {tbs:.2f} |  max|fa4-dense| {err:.1e}", flush=True)
    del case, out, ref

print("\nnum_chunks sweep, decode fast path (max_seqlen_q=1, Triton merge), CUDA graph replay, microseconds")
sweep = (8, 12, 16, 24, 32, 48, 64)
print("| batch x context | " + " | ".join(f"{c} chunks" for c in sweep) + " |")
print("| --- | " + " | ".join("---" for _ in sweep) + " |")
for b, ctx in ((1, 32768), (1, 131072)):
    case = decode_case(b, ctx)
    row = [graph_us(fa4(case, c, max_seqlen_q=1))[0] for c in sweep]
    print(f"| {b} x {ctx // 1024}K (auto {choose_num_chunks(b, HKV, ctx, sms)}) | " + " | ".join(f"{us:.0f}" for us in row) + " |", flush=True)
    del case
print("Triton split kernels on at the end:", pa._SPLIT_TRITON)
EOF
echo "done: $(date -u)"

"""Where a flash-attn-4 call's host time goes (the Python before the kernel launch), on one GPU: the
ring block (dense, causal, LSE) and the paged call of an incremental prefill, llama3-8b shapes, each
timed without synchronization and run under cProfile. Usage: python scripts/gpu_fa4_host.py"""
import cProfile
import io
import pstats
import time

import torch

from kernels.attention import _flash_attn_4
from kernels.paged_attention import _fa4_call, guarded_table

dev = torch.device("cuda:0")
h, hkv, d, bs, n, cached = 32, 8, 128, 128, 256, 2048
q = torch.randn(n, h, d, device=dev, dtype=torch.bfloat16)
k = torch.randn(n, hkv, d, device=dev, dtype=torch.bfloat16)
v = torch.randn_like(k)
pages = (cached + n) // bs
k_cache = torch.randn(pages + 1, bs, hkv, d, device=dev, dtype=torch.bfloat16)
v_cache = torch.randn_like(k_cache)
table = guarded_table(torch.arange(1, pages + 1, device=dev, dtype=torch.int32)[None])
cu = torch.tensor([0, n], device=dev, dtype=torch.int32)
used = torch.tensor([cached + n], device=dev, dtype=torch.int32)
calls = {
    "dense causal 256 x 256 (ring block)": lambda: _flash_attn_4(q, k, v, True, 0.088),
    "paged causal 256 after 2048": lambda: _fa4_call(q, k_cache, v_cache, table, cu, used, 0.088, True, n),
}
for name, call in calls.items():
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        call()
    host = (time.perf_counter() - t0) / 200
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        call()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    print(f"## {name}: {host * 1e6:.1f} us of host time per call\n")
    print("```\n" + text.getvalue()[-9000:] + "\n```\n")

"""Where a flash-attn-4 call's host time goes (the Python before the kernel launch), on one GPU: the
ring block (dense, causal, LSE) and the paged call of an incremental prefill, llama3-8b shapes. Each is
timed without synchronization (mean of 500 calls) through the public functions, as kernels/ calls
them, and straight through `_flash_attn_fwd` (no autograd Function around it), then run under
cProfile. Usage: python scripts/gpu_fa4_host.py"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch
from flash_attn.cute.interface import _flash_attn_fwd

from burstserve.kernels.attention import _flash_attn_4
from burstserve.kernels.paged_attention import _fa4_call, guarded_table

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
q1, k1, v1 = q[None], k[None], v[None]
calls = {
    "dense causal 256 x 256, kernels.attention._flash_attn_4": lambda: _flash_attn_4(q, k, v, True, 0.088),
    "dense causal 256 x 256, _flash_attn_fwd": lambda: _flash_attn_fwd(q1, k1, v1, softmax_scale=0.088, causal=True,
                                                                       return_lse=True),
    "paged causal 256 after 2048, kernels.paged_attention._fa4_call":
        lambda: _fa4_call(q, k_cache, v_cache, table, cu, used, 0.088, True, n),
    "paged causal 256 after 2048, _flash_attn_fwd":
        lambda: _flash_attn_fwd(q, k_cache, v_cache, cu_seqlens_q=cu, seqused_k=used, page_table=table, max_seqlen_q=n,
                                softmax_scale=0.088, causal=True, return_lse=True),
}


def host_us(call, repeats=500) -> float:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
    host = (time.perf_counter() - t0) / repeats
    torch.cuda.synchronize()
    return host * 1e6


print("| call | host us (FLASH_ATTENTION_NUM_SMS unset) |\n|---|---|")
for name, call in calls.items():
    print(f"| {name} | {host_us(call):.1f} |")
os.environ["FLASH_ATTENTION_NUM_SMS"] = str(torch.cuda.get_device_properties(dev).multi_processor_count)
print("\n| call | host us (FLASH_ATTENTION_NUM_SMS set) |\n|---|---|")
for name, call in calls.items():
    print(f"| {name} | {host_us(call):.1f} |")
if "--cprofile" in sys.argv:
    for name, call in calls.items():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            call()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(f"\n## {name} under cProfile\n\n```\n{text.getvalue()[-7000:]}\n```")

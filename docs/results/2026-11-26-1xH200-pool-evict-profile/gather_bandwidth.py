"""Throwaway: Fp8Pages.gather's bandwidth at 128K tokens (llama3-8b: 8 KV heads, d 128, pages of 128)."""
import torch
from kernels.kv_quant import Fp8Pages
dev = "cuda"
bs, hkv, d, n = 128, 8, 128, 131072
blocks_total = 2048
pages = Fp8Pages(torch.randint(0, 120, (blocks_total, bs, hkv, d), dtype=torch.uint8, device=dev),
                 torch.rand(blocks_total, bs, hkv, device=dev).to(torch.bfloat16))
for order in ("contiguous", "shuffled"):
    blocks = torch.arange(n // bs, device=dev) if order == "contiguous" else torch.randperm(blocks_total, device=dev)[: n // bs]
    for _ in range(3):
        pages.gather(blocks, n, torch.bfloat16)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        pages.gather(blocks, n, torch.bfloat16)
    b.record(); torch.cuda.synchronize()
    ms = a.elapsed_time(b) / 20
    moved = n * hkv * (d + 2) + n * hkv * d * 2
    print(f"| gather {order} {n} tokens -> bf16 | {ms:.3f} ms | {moved / ms / 1e6:.0f} GB/s |")
x = torch.empty(n * hkv * d * 3 // 2, dtype=torch.uint8, device=dev)
y = torch.empty_like(x)
a.record()
for _ in range(20):
    y.copy_(x)
b.record(); torch.cuda.synchronize()
ms = a.elapsed_time(b) / 20
print(f"| copy of the same bytes (baseline) | {ms:.3f} ms | {2 * x.numel() / ms / 1e6:.0f} GB/s |")

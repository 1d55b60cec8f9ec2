"""Diagnostic: each GPU kernel vs the fp32 reference over odd lengths, strided (packed) and contiguous K/V."""
import torch
from kernels.attention import AttentionBackend, _GPU_BACKENDS, reference_attention

dev = torch.device("cuda:0")
print(f"{'kernel':6} {'Sq':>6} {'Sk':>6} {'causal':6} {'layout':7} {'out_err':>9} {'lse_err':>9}")
for name in ("cudnn", "flash"):
    b = AttentionBackend(name, _GPU_BACKENDS[name])
    for sq, sk, causal in ((1025, 1025, True), (2050, 1025, False), (1024, 2049, False), (2049, 2049, True),
                           (4099, 4099, True), (1, 333, False), (1000, 1000, True), (16384, 16384, True)):
        q = torch.randn(sq, 32, 128, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(sk, 2, 8, 128, device=dev, dtype=torch.bfloat16)
        ref_o, ref_l = reference_attention(q, kv[:, 0], kv[:, 1], causal, 128 ** -0.5, query_chunk=512)
        for layout, (k, v) in (("packed", (kv[:, 0], kv[:, 1])), ("contig", (kv[:, 0].contiguous(), kv[:, 1].contiguous()))):
            try:
                o, l = b(q, k, v, causal, 128 ** -0.5)
                print(f"{name:6} {sq:6} {sk:6} {causal!s:6} {layout:7} {(o.float()-ref_o.float()).abs().max().item():9.4f} {(l-ref_l).abs().max().item():9.5f}")
            except Exception as e:
                print(f"{name:6} {sq:6} {sk:6} {causal!s:6} {layout:7} ERROR {type(e).__name__}: {str(e)[:80]}")

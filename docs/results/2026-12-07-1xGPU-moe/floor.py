"""The floor of the qwen3-30b-a3b preset on one GPU, bf16, measured as bare kernels on the same machine:
TTFT(L) = 48 layers x (flash-attn-4's causal call over L tokens [32 q / 4 KV heads, d 128] + the dense GEMMs q/k/v,
o and the router + the experts' two grouped GEMMs at the token counts a random router gives, inputs already sorted);
TPOT(B x L) = the bytes a decode step must read (the attention's weights, the experts B rows choose in each layer: 8 at
one row, E (1 - (1 - 8/E)^B) expected for B rows routed uniformly, the LM head, B L tokens of KV) at the rate of a bare
device-to-device copy; tokens/s B / TPOT.
python3 docs/results/2026-12-07-1xGPU-moe/floor.py 8192,32768"""
import sys

import torch
import torch.nn.functional as F

from burstserve.kernels.attention import _GPU_BACKENDS

LAYERS, HID, H, HKV, D, E, K, INTER, VOCAB = 48, 2048, 32, 4, 128, 128, 8, 768, 151936
dev = torch.device("cuda")
bf = torch.bfloat16


def timed(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters / 1e3      # s


def prefill_floor(n: int) -> dict:
    x = torch.randn(n, HID, device=dev, dtype=bf)
    q = torch.randn(n, H, D, device=dev, dtype=bf)
    k, v = torch.randn(n, HKV, D, device=dev, dtype=bf), torch.randn(n, HKV, D, device=dev, dtype=bf)
    attn = timed(lambda: _GPU_BACKENDS["flash_attn_4"](q, k, v, True, D ** -0.5))
    w_qkv = torch.randn((H + 2 * HKV) * D, HID, device=dev, dtype=bf)
    w_o = torch.randn(HID, H * D, device=dev, dtype=bf)
    router = torch.randn(E, HID, device=dev, dtype=bf)
    o_in = torch.randn(n, H * D, device=dev, dtype=bf)
    dense = timed(lambda: (F.linear(x, w_qkv), F.linear(o_in, w_o), F.linear(x, router)))
    chosen = torch.topk(torch.softmax(F.linear(x, router * 0.02).float(), -1), K, dim=-1)[1].flatten()
    counts = torch.bincount(chosen, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gate_up = torch.randn(E, 2 * INTER, HID, device=dev, dtype=bf) * 0.02
    down = torch.randn(E, HID, INTER, device=dev, dtype=bf) * 0.02
    rows = torch.randn(n * K, HID, device=dev, dtype=bf)
    mid = torch.randn(n * K, INTER, device=dev, dtype=bf)
    experts = timed(lambda: (torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs),
                             torch._grouped_mm(mid, down.transpose(-2, -1), offs=offs)))
    return {"attention": LAYERS * attn, "dense": LAYERS * dense, "experts": LAYERS * experts}


def copy_rate() -> float:
    src = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), iters=5)     # bytes read + written a second


def decode_floor_bytes(context: int, batch: int = 1) -> int:
    attn = LAYERS * ((H + 2 * HKV) * D * HID + HID * H * D + E * HID + 2 * D) * 2
    chosen = K if batch == 1 else E * (1 - (1 - K / E) ** batch)
    experts = int(LAYERS * chosen * 3 * INTER * HID * 2)
    head = VOCAB * HID * 2 + HID * 2
    kv = LAYERS * batch * context * 2 * HKV * D * 2
    return attn + experts + head + kv


if __name__ == "__main__":
    lengths = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8192,32768").split(",")]
    print(f"GPU: {torch.cuda.get_device_name(dev)}")
    print("| prompt tokens | attention s | dense GEMMs s | experts' grouped GEMMs s | TTFT floor s |")
    print("|---|---|---|---|---|")
    for n in lengths:
        f = prefill_floor(n)
        print(f"| {n} | {f['attention']:.3f} | {f['dense']:.3f} | {f['experts']:.3f} | {sum(f.values()):.3f} |")
        torch.cuda.empty_cache()
    rate = copy_rate()
    print(f"\ndevice copy: {rate / 1e12:.2f} TB/s")
    print("| rows x context | bytes a decode step reads, GB | TPOT floor ms | tokens/s floor |")
    print("|---|---|---|---|")
    for batch, ctx in ((1, 8192), (1, 131072), (16, 8192), (64, 2048)):
        b = decode_floor_bytes(ctx, batch)
        print(f"| {batch} x {ctx} | {b / 1e9:.2f} | {b / rate * 1e3:.2f} | {batch * rate / b:.0f} |")

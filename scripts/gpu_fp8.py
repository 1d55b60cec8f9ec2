"""FP8 against bf16 on one GPU (issue 13 item 4): the llama3-8b preset's decoder built from the same
random weights in fp32 (the yardstick), bf16 and bf16 with --quantization fp8; one forward pass over
the same prompt of N tokens each; every position's logits compared with fp32's (relative error of the
centered logits, max |diff|, top-1 agreement), and the bf16 and fp8 forward passes timed (the
single-GPU prefill: no ring). Prints a table; writes fp8.json to $OUT. Random weights: the errors
say how far FP8 moves this model against how far bf16 does, not a trained model's accuracy.

    python scripts/gpu_fp8.py 8192 16384
    FP8_PRESET=tiny FP8_DEVICE=cpu python scripts/gpu_fp8.py 256     (a dry run here)
"""
import json
import os
import sys
import time

import torch

from burstserve.engine.model.config import preset_config
from burstserve.engine.model.model import LlamaModel, hf_weight_shapes
from burstserve.engine.model.weights import random_weights
from burstserve.kernels.attention import select_backend


def forward_logits(model, ids, attend, rows: int) -> torch.Tensor:
    hidden = model.forward(ids, torch.arange(ids.shape[0], device=ids.device), attend)
    return torch.cat([model.logits(hidden[i:i + rows]) for i in range(0, hidden.shape[0], rows)])


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats=3) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    lengths = [int(x) for x in sys.argv[1:]] or [8192]
    dev, dtype = torch.device(os.environ.get("FP8_DEVICE", "cuda:0")), torch.bfloat16
    cfg = preset_config(os.environ.get("FP8_PRESET", "llama3-8b"))
    backend = select_backend(dev, dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, "auto")
    scale = cfg.head_dim ** -0.5
    attend = lambda layer, q, k, v: backend(q, k, v, True, scale)[0]     # noqa: E731

    def attend_fp32(layer, q, k, v):                                      # PyTorch's attention, fp32
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)),
                                                               is_causal=True)
        return out[0].transpose(0, 1)
    weights = lambda dt: random_weights(hf_weight_shapes(cfg), dev, dt, seed=0)      # noqa: E731
    models = {q: LlamaModel(cfg, weights(dtype), dev, quantization=q) for q in ("none", "fp8")}
    exact = LlamaModel(cfg, weights(torch.float32), dev) if os.environ.get("FP8_FP32", "1") == "1" else None
    rows = []
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (n,), device=dev)
        with torch.inference_mode():
            try:
                ref = forward_logits(exact, ids, attend_fp32, 2048) if exact is not None else None   # [n, V] fp32
            except Exception as e:              # (say the fp32 model's kernels refuse): fp8 against bf16
                print(f"fp32 yardstick failed ({type(e).__name__}: {e}); comparing FP8 with bf16", file=sys.stderr)
                ref = None
            row = {"tokens": n, "kernel": backend.name}
            for q, m in models.items():
                got = forward_logits(m, ids, attend, 2048)
                if ref is None:
                    ref = got                                   # no fp32 yardstick: fp8 against bf16
                    continue
                centered = (ref - ref.mean(-1, keepdim=True)).norm()
                row[q] = {"relative_error": float((got - ref).norm() / centered),
                          "max_abs_diff": float((got - ref).abs().max()),
                          "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean())}
                del got
            row["logit_std"] = float(ref.std())
            row["seconds"] = {q: timed(lambda m=m: m.forward(ids, torch.arange(n, device=dev), attend))
                              for q, m in models.items()}
            del ref
        rows.append(row)
        torch.cuda.empty_cache()
    print("| tokens | bf16 forward s | fp8 forward s | speed-up | vs fp32: bf16 rel. error | fp8 rel. error | "
          "bf16 max abs diff | fp8 max abs diff | bf16 top-1 | fp8 top-1 | logit std |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s, b, f = r["seconds"], r.get("none", {}), r["fp8"]
        cell = lambda d, k, fmt: format(d[k], fmt) if k in d else "-"      # noqa: E731
        print(f"| {r['tokens']} | {s['none']:.3f} | {s['fp8']:.3f} | {s['none'] / s['fp8']:.2f}x | "
              f"{cell(b, 'relative_error', '.4f')} | {f['relative_error']:.4f} | {cell(b, 'max_abs_diff', '.3f')} | "
              f"{f['max_abs_diff']:.3f} | {cell(b, 'top1_agreement', '.3f')} | {f['top1_agreement']:.3f} | "
              f"{r['logit_std']:.3f} |")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fp8.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()

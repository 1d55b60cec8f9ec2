"""FP8 against bf16 on one GPU (issue 13 item 4): the llama3-8b preset's decoder built twice from the
same random weights, bf16 and --quantization fp8, one forward pass over the same prompt of N tokens
each, all positions' logits compared (relative error, max |diff|, top-1 agreement), and the forward
pass timed (the single-GPU prefill: no ring). Prints a table; writes fp8.json to $OUT.

    python scripts/gpu_fp8.py 8192 16384
    FP8_PRESET=tiny FP8_DEVICE=cpu python scripts/gpu_fp8.py 256     (a dry run here)
"""
import json
import os
import sys
import time

import torch

from engine.config import preset_config
from engine.model import LlamaModel, hf_weight_shapes
from engine.weights import random_weights
from kernels.attention import select_backend


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
    models = {q: LlamaModel(cfg, random_weights(hf_weight_shapes(cfg), dev, dtype, seed=0), dev, quantization=q)
              for q in ("none", "fp8")}
    rows = []
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (n,), device=dev)
        with torch.inference_mode():
            logits = {q: forward_logits(m, ids, attend, 2048) for q, m in models.items()}   # [n, V] fp32
            ref, got = logits["none"], logits["fp8"]
            centered = (ref - ref.mean(-1, keepdim=True)).norm()
            row = {"tokens": n, "kernel": backend.name,
                   "relative_error": float((got - ref).norm() / centered),
                   "max_abs_diff": float((got - ref).abs().max()), "logit_std": float(ref.std()),
                   "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                   "seconds": {q: timed(lambda m=m: m.forward(ids, torch.arange(n, device=dev), attend))
                               for q, m in models.items()}}
            del logits, ref, got
        rows.append(row)
        torch.cuda.empty_cache()
    print("| tokens | bf16 forward s | fp8 forward s | speed-up | logits' relative error | max abs diff | logit std "
          "| top-1 agreement |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["seconds"]
        print(f"| {r['tokens']} | {s['none']:.3f} | {s['fp8']:.3f} | {s['none'] / s['fp8']:.2f}x | "
              f"{r['relative_error']:.4f} | {r['max_abs_diff']:.3f} | {r['logit_std']:.3f} | {r['top1_agreement']:.3f} |")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fp8.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()

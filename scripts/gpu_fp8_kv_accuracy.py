"""The FP8 KV cache's accuracy on one GPU (issue 35): the llama3-8b preset's decoder (engine.model.LlamaModel)
from the same random weights, with an outlier channel planted in every layer's keys (one RoPE pair of each
KV head's K projection scaled by OUTLIER, as trained models' keys have them), in fp32 (the yardstick) and in
bf16 with K/V in bf16, with K/V in FP8 (--kv-cache-dtype fp8: the model rounds K/V as the pages keep them),
and with FP8 K/V and --quantization fp8. For each prompt length: every prompt position's logits against
fp32's (relative error of the centered logits, max |diff|, top-1 agreement), then 256 greedy steps teacher-
forced on fp32's own greedy tokens (top-1 agreement per step, and the first step that differs), each
variant attending its own dense K/V cache (exactly the values its pages would hold). Random weights: the
errors say how far each storage moves this model, not a trained model's accuracy.

    python scripts/gpu_fp8_kv_accuracy.py [TOKENS ...]          default: 8192 32768
    OUTLIER=20 STEPS=256 python scripts/gpu_fp8_kv_accuracy.py
    ACC_PRESET=tiny ACC_DEVICE=cpu STEPS=8 python scripts/gpu_fp8_kv_accuracy.py 512     (a dry run here)

Prints a table; writes fp8_kv_accuracy.json under $OUT (or the working directory).
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

from burstserve.engine.model.config import preset_config
from burstserve.engine.model.model import LlamaModel, hf_weight_shapes
from burstserve.engine.model.weights import random_weights

VARIANTS = {"bf16": dict(kv_cache_dtype="auto"), "fp8 KV": dict(kv_cache_dtype="fp8"),
            "fp8 KV + -q fp8": dict(kv_cache_dtype="fp8", quantization="fp8")}
OUTLIER_CHANNEL = 7                              # and its RoPE partner, channel 7 + D / 2


class DenseCache:
    """Each layer's K/V in one preallocated tensor: attend() appends this call's rows and attends the
    queries (causal within the call) to everything cached."""

    def __init__(self, layers: int, capacity: int, hkv: int, d: int, dtype, device):
        self.k = torch.empty(layers, capacity, hkv, d, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, end = q.shape[0], self.length + q.shape[0]
        self.k[layer, self.length:end], self.v[layer, self.length:end] = k, v
        g = q.shape[1] // k.shape[1]
        keys = self.k[layer, :end].repeat_interleave(g, 1).transpose(0, 1)[None]       # [1, H, end, D]
        values = self.v[layer, :end].repeat_interleave(g, 1).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, is_causal=s > 1)
        if layer == self.k.shape[0] - 1:
            self.length = end
        return out[0].transpose(0, 1)


def weights_with_outliers(cfg, device, dtype, factor: float) -> dict:
    w = random_weights(hf_weight_shapes(cfg), device, dtype, seed=0)
    d = cfg.head_dim
    for name, t in w.items():
        if name.endswith("k_proj.weight"):                                  # [Hkv * D, hidden]
            rows = torch.tensor([g * d + c for g in range(cfg.num_kv_heads)
                                 for c in (OUTLIER_CHANNEL, OUTLIER_CHANNEL + d // 2)], device=device)
            t[rows] *= factor
    return w


@torch.inference_mode()
def run(model, cfg, prompt: torch.Tensor, positions: torch.Tensor, steps: int, forced: list[int] | None, dtype):
    """Prefill then `steps` greedy steps (on `forced` tokens if given) -> (the logits at these prompt
    positions [p, V] fp32, greedy tokens [steps], the steps' logits [steps, V] fp32)."""
    dev = prompt.device
    n = prompt.shape[0]
    cache = DenseCache(cfg.num_layers, n + steps, cfg.num_kv_heads, cfg.head_dim, dtype, dev)
    hidden = model.forward(prompt, torch.arange(n, device=dev), cache.attend)
    prompt_logits = model.logits(hidden[positions]).float()
    logits = model.logits(hidden[-1:]).float()
    del hidden
    tokens, step_logits = [], []
    for i in range(steps):
        step_logits.append(logits[0])
        tokens.append(int(logits[0].argmax()))
        nxt = forced[i] if forced is not None else tokens[-1]
        h = model.forward(torch.tensor([nxt], device=dev), torch.tensor([n + i], device=dev), cache.attend)
        logits = model.logits(h).float()
    del cache
    return prompt_logits, tokens, torch.stack(step_logits)


def compare(got, ref) -> dict:
    centered = (ref - ref.mean(-1, keepdim=True)).norm()
    return {"relative_error": float((got - ref).norm() / centered), "max_abs_diff": float((got - ref).abs().max()),
            "top1": float((got.argmax(-1) == ref.argmax(-1)).float().mean())}


def main() -> None:
    lengths = [int(x) for x in sys.argv[1:]] or [8192, 32768]
    steps, factor = int(os.environ.get("STEPS", "256")), float(os.environ.get("OUTLIER", "20"))
    dev = torch.device(os.environ.get("ACC_DEVICE", "cuda:0"))
    cfg = preset_config(os.environ.get("ACC_PRESET", "llama3-8b"))
    rows = []
    for n in lengths:
        prompt = torch.randint(0, cfg.vocab_size, (n,), device=dev, generator=torch.Generator(dev).manual_seed(n))
        positions = torch.cat([torch.arange(0, n - 256, 64), torch.arange(n - 256, n)]).to(dev)   # sampled + last
        exact = LlamaModel(cfg, weights_with_outliers(cfg, dev, torch.float32, factor), dev)
        ref_prompt, ref_tokens, ref_steps = run(exact, cfg, prompt, positions, steps, None, torch.float32)
        del exact
        torch.cuda.empty_cache()
        row = {"tokens": n, "steps": steps, "outlier": factor, "prompt_positions": len(positions),
               "logit_std": float(ref_steps.std())}
        for name, opts in VARIANTS.items():
            model = LlamaModel(cfg, weights_with_outliers(cfg, dev, torch.bfloat16, factor), dev, **opts)
            got_prompt, _, got_steps = run(model, cfg, prompt, positions, steps, ref_tokens, torch.bfloat16)
            same = (got_steps.argmax(-1) == ref_steps.argmax(-1)).tolist()
            row[name] = {"prompt": compare(got_prompt, ref_prompt), "steps": compare(got_steps, ref_steps),
                         "first_different_step": same.index(False) if False in same else None}
            del model, got_prompt, got_steps
            torch.cuda.empty_cache()
        rows.append(row)
    print(f"vs fp32, K with an outlier channel (x{factor}); prompt: every 64th position and the last 256; "
          f"greedy: {steps} steps teacher-forced on fp32's tokens")
    print("| prompt tokens | K/V (weights) | prompt logits rel. error | max abs diff | top-1 | steps' rel. error | "
          "max abs diff | top-1 | first differing step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for name in VARIANTS:
            p, s = r[name]["prompt"], r[name]["steps"]
            print(f"| {r['tokens']} | {name} | {p['relative_error']:.4f} | {p['max_abs_diff']:.3f} | {p['top1']:.3f} | "
                  f"{s['relative_error']:.4f} | {s['max_abs_diff']:.3f} | {s['top1']:.3f} | "
                  f"{r[name]['first_different_step']} |")
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_kv_accuracy.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""transformers on one GPU: the baseline a user would pick instead. Prints one JSON line per length.

    python -m clients.hf_baseline --model llama3-8b --lengths 32768,131072 --repeats 2
Random weights with the preset's shapes (or a local checkpoint); prefill only, logits of the last
position only (`logits_to_keep=1`), sdpa attention, bf16; OOM is reported as OOM.
"""
import argparse
import json
import time

import torch


def build_model(model: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    from engine.config import preset_config, preset_names
    if model not in preset_names():
        return LlamaForCausalLM.from_pretrained(model, torch_dtype=dtype, attn_implementation="sdpa").cuda().eval()
    c = preset_config(model)
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                      max_position_embeddings=1 << 20, rms_norm_eps=c.rms_norm_eps)
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(dtype)
    with torch.device("cuda"):
        m = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return m.eval()


@torch.inference_mode()
def time_prefill(model, length: int, repeats: int) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, length), device="cuda")
    times = []
    try:
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"prompt_tokens": length, "oom": True}
    return {"prompt_tokens": length, "seconds": min(times), "mean_seconds": sum(times) / len(times),
            "peak_memory_bytes": torch.cuda.max_memory_allocated()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    model = build_model(args.model, torch.bfloat16)
    time_prefill(model, 1024, 1)   # warm-up
    for n in [int(x) for x in args.lengths.split(",")]:
        torch.cuda.reset_peak_memory_stats()
        print(json.dumps(time_prefill(model, n, args.repeats)), flush=True)


if __name__ == "__main__":
    main()

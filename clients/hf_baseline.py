"""transformers on one GPU: the baseline a user would pick instead, measured by the same sweep.

    burstserve bench sweep --offline --sp-strategy transformers --model llama3-8b --devices cuda
Random weights with the preset's shapes (or a local checkpoint), `LlamaForCausalLM` with sdpa
attention in bf16; a request is one forward pass over the prompt with the KV cache on and the
logits of the last position only (`logits_to_keep=1`), then the greedy token on the host: the same
work the engine does before its first token. OOM is reported as OOM.
"""
import random
import time

import torch

from clients.sweep import make_row, timed_requests
from engine.devices import synchronize
from engine.errors import DeviceSpecError


def build_model(model: str, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM
    from engine.config import preset_config, preset_names
    if model not in preset_names():
        return LlamaForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    c = preset_config(model)
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
                      max_position_embeddings=1 << 20, rms_norm_eps=c.rms_norm_eps)
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(dtype)
    try:
        with device:
            m = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    return m.eval()


@torch.inference_mode()
def first_token_seconds(model, length: int) -> float:
    """One request: prompt of `length` random ids -> seconds to the greedy first token on the host."""
    device = model.device
    ids = torch.tensor([[random.randrange(model.config.vocab_size) for _ in range(length)]])
    synchronize(device)
    start = time.perf_counter()
    logits = model(ids.to(device), use_cache=True, logits_to_keep=1).logits
    int(logits[0, -1].argmax())
    return time.perf_counter() - start


def baseline_device(devices: str | None, context_parallel_size: int | None = None) -> torch.device:
    """The first device `devices` names (default: GPU 0, else cpu); transformers runs on one device only."""
    from engine.devices import check_context_parallel_size, resolve_devices
    if (check_context_parallel_size(context_parallel_size) or 1) > 1:
        raise DeviceSpecError(f"--sp-strategy transformers runs on one device, not {context_parallel_size}: "
                              "drop --context-parallel-size (or use 1)")
    return torch.device(resolve_devices(devices, 1)[0])


def sweep_transformers(model: str, devices: str | None, dtype: str | None, lengths: list[int], repeats: int,
                       warmup: int, label: str | None, progress, context_parallel_size: int | None = None):
    """Yields the sweep's rows for transformers on the first device of `devices` (default cuda, else cpu).
    An error (OOM) ends it: longer prompts are not tried."""
    device = baseline_device(devices, context_parallel_size)
    torch_dtype = getattr(torch, dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    lm = build_model(model, torch_dtype, device)
    first_token_seconds(lm, 16)   # warm-up
    fields = {"strategy": "transformers", "devices": str(device), "num_devices": 1, "context_parallel_size": 1,
              "kernel": "sdpa"}
    label = label or f"transformers, 1 device ({device.type})"
    for n in lengths:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        warm, error = timed_requests(warmup, lambda: first_token_seconds(lm, n), progress)
        timed, error = timed_requests(repeats, lambda: first_token_seconds(lm, n), progress) if not error \
            else ([], error)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        yield make_row(label, fields, n, timed, timed, error, warm, {"peak_memory_gib": peak})
        if error:
            break
    del lm

"""transformers on one GPU: the baseline a user would pick instead, measured by the same sweep.

    burstserve bench sweep --offline --sp-strategy transformers --model llama3-8b --devices cuda
    burstserve bench sweep --offline --sp-strategy transformers --model llama3-8b --devices cuda \
        --lengths 8192 --output-len 128 --batch 16
Random weights with the preset's shapes (or a local checkpoint), `LlamaForCausalLM` (a mixture of experts:
`Qwen3MoeForCausalLM` or `MixtralForCausalLM`, experts as transformers' grouped GEMM) with sdpa attention in bf16. With --output-len 1 (TTFT only) a request is one forward pass over the prompt with
the KV cache on and the logits of the last position only (`logits_to_keep=1`), then the greedy token
on the host: the same work the engine does before its first token. With --output-len N > 1 a batch is
one `model.generate` call, greedy, exactly N new tokens (`min_new_tokens`), its tokens timed as a
streamer receives them on the host: on CUDA with a static KV cache (`cache_implementation="static"`),
which transformers decodes with `torch.compile(mode="reduce-overhead")` (the row's `decode_mode` says
whether it did: "static+compile", else "static, eager"); on CPU with the default dynamic cache, eager
("dynamic, eager"). The B prompts of a batch go as one [B, n] tensor, so they share every timing.
OOM is reported as OOM.
"""
import functools
import random
import time

import torch

from burstserve.clients.stats import RequestTiming
from burstserve.clients.sweep import check_generated, default_label, make_row, timed_requests
from burstserve.engine.core.devices import synchronize
from burstserve.engine.core.errors import DeviceSpecError


def build_model(model: str, dtype: torch.dtype, device: torch.device):
    """transformers' model of a checkpoint or of a preset's shapes (random weights), sdpa attention; a mixture of
    experts with transformers' fastest experts implementation there (its grouped GEMM on CUDA)."""
    from transformers import AutoModelForCausalLM
    from burstserve.engine.model.config import preset_config, preset_names
    experts = "grouped_mm" if device.type == "cuda" else "eager"
    if model not in preset_names():
        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa",
                                                    experts_implementation=experts).to(device).eval()
    cfg = hf_config(preset_config(model))
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = experts
    torch.set_default_dtype(dtype)
    try:
        with device:
            m = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    return m.eval()


def hf_config(c):
    """transformers' config of a preset's shapes (engine/model/config.py ModelConfig): LLaMA, or the mixture of experts
    whose names the preset's checkpoint would carry (Mixtral, Qwen3-MoE)."""
    from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  head_dim=c.head_dim, rope_theta=c.rope_theta, max_position_embeddings=1 << 20,
                  rms_norm_eps=c.rms_norm_eps)
    if not c.num_experts:
        return LlamaConfig(**common)
    if c.expert_names == "mixtral":
        return MixtralConfig(**common, num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)
    return Qwen3MoeConfig(**common, num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                          moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                          mlp_only_layers=[i for i in range(c.num_layers) if not c.is_sparse(i)])


def random_prompts(model, batch: int, length: int) -> torch.Tensor:
    """[batch, length] random token ids on the model's device."""
    ids = torch.tensor([[random.randrange(model.config.vocab_size) for _ in range(length)] for _ in range(batch)])
    return ids.to(model.device)


@torch.inference_mode()
def first_token_timings(model, length: int, batch: int = 1) -> list[RequestTiming]:
    """One batch of `batch` prompts of `length` random ids -> the greedy first tokens on the host (one forward)."""
    ids = random_prompts(model, batch, length)
    synchronize(model.device)
    start = time.perf_counter()
    logits = model(ids, use_cache=True, logits_to_keep=1).logits     # [B, 1, V]
    logits[:, -1].argmax(-1).tolist()
    done = time.perf_counter()
    return [RequestTiming(start, [done], done - start) for _ in range(batch)]


class TokenClock:
    """generate()'s streamer: when each step's new tokens reached the host (the prompt's put is skipped).
    transformers calls put with tensors already copied to the host, so each reading follows the device."""

    def __init__(self):
        self.prompt_seen, self.times = False, []

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def generate_kwargs(device: torch.device) -> dict:
    """What a transformers user picks for fast greedy decoding: on CUDA a static cache, which generate
    compiles (reduce-overhead: CUDA graphs); elsewhere the default dynamic cache, eager."""
    if device.type != "cuda":
        return {}
    from transformers import CompileConfig
    return {"cache_implementation": "static", "compile_config": CompileConfig(mode="reduce-overhead")}


@torch.inference_mode()
def generate_timings(model, length: int, output_len: int, batch: int = 1) -> list[RequestTiming]:
    """One batch through model.generate: `batch` prompts of `length` random ids, exactly `output_len` greedy
    tokens each -> their timings (perf_counter seconds; the rows of a batch share them)."""
    ids = random_prompts(model, batch, length)                  # [B, n]
    clock = TokenClock()
    synchronize(model.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=output_len,
                         min_new_tokens=output_len, pad_token_id=0, streamer=clock,
                         **generate_kwargs(model.device))       # [B, n + output_len]
    check_generated(out.shape[1] - length, output_len)
    check_generated(len(clock.times), output_len)
    return [RequestTiming(start, list(clock.times), clock.times[0] - start) for _ in range(batch)]


def timed_batch(model, length: int, output_len: int, batch: int) -> list[RequestTiming]:
    """One batch of requests: generate when tokens follow the first, else the single forward."""
    if output_len > 1:
        return generate_timings(model, length, output_len, batch)
    return first_token_timings(model, length, batch)


def decode_mode(model) -> str:
    """How generate decoded (after a call): generate keeps its compiled forward on the model."""
    if model.device.type != "cuda":
        return "dynamic, eager"
    return "static+compile" if hasattr(model, "_compiled_call") else "static, eager"


def baseline_device(devices: str | None, context_parallel_size: int | None = None) -> torch.device:
    """The first device `devices` names (default: GPU 0, else cpu); transformers runs on one device only."""
    from burstserve.engine.core.devices import check_context_parallel_size, resolve_devices
    if (check_context_parallel_size(context_parallel_size) or 1) > 1:
        raise DeviceSpecError(f"--sp-strategy transformers runs on one device, not {context_parallel_size}: "
                              "drop --context-parallel-size (or use 1)")
    return torch.device(resolve_devices(devices, 1)[0])


def sweep_transformers(model: str, devices: str | None, dtype: str | None, lengths: list[int], repeats: int,
                       warmup: int, label: str | None, progress, context_parallel_size: int | None = None,
                       output_len: int = 1, batch: int = 1):
    """Yields the sweep's rows for transformers on the first device of `devices` (default cuda, else cpu).
    An error (OOM) ends it: longer prompts are not tried."""
    device = baseline_device(devices, context_parallel_size)
    torch_dtype = getattr(torch, dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    fields = {"strategy": "transformers", "devices": str(device), "num_devices": 1, "context_parallel_size": 1,
              "kernel": "sdpa"}
    label = label or default_label(f"transformers, 1 device ({device.type})", batch)
    try:
        lm = build_model(model, torch_dtype, device)
        timed_batch(lm, 16, output_len, batch)   # warm-up (on CUDA with tokens to decode: compiles)
    except torch.cuda.OutOfMemoryError as e:     # the model alone does not fit (a 70B on one GPU): OOM at every length
        error = f"{type(e).__name__}: {e}"
        for n in lengths:
            yield make_row(label, fields, n, [], error, [], {"peak_memory_gib": 0.0}, output_len, batch)
        return
    if output_len > 1:
        fields["decode_mode"] = decode_mode(lm)
    for n in lengths:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        send = functools.partial(timed_batch, lm, n, output_len, batch)
        warm, error = timed_requests(warmup, send, progress)
        timed, error = timed_requests(repeats, send, progress) if not error else ([], error)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        yield make_row(label, fields, n, timed, error, warm, {"peak_memory_gib": peak}, output_len, batch)
        if error:
            break
    del lm

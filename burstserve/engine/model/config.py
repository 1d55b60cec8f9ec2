"""Model and engine configuration: one dataclass each, passed down (no global flags)."""
import difflib
import json
import os
from dataclasses import dataclass, field

import torch

from burstserve.engine.core.errors import ModelLoadError
from burstserve.engine.model.gguf import PACKAGED_MODELS

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",     # its language model (text_config), served alone
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")   # engine/model/rope.py; "dynamic" NTK is refused: its frequencies
                                                      # follow the longest sequence in a forward pass, which a KV
                                                      # cache cannot (transformers' own cached generate drifts)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_dtype(devices: list[str]) -> str:
    """The dtype when none is named: bfloat16 on GPUs, float32 on CPU."""
    return "bfloat16" if devices[0].startswith("cuda") else "float32"


@dataclass
class ModelConfig:
    """The shapes of a LLaMA-family decoder, read from a transformers config.json or a preset."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # {"rope_type": "linear"|"llama3"|"yarn", ...} (None: default RoPE)
    qkv_bias: bool = False             # Qwen2
    qk_norm: bool = False              # Qwen3: an RMSNorm over each head of q and k (weights [D]) before RoPE
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # a mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE; engine/model/moe.py); num_experts 0: every MLP dense
    num_experts: int = 0
    num_experts_per_tok: int = 0               # experts each token is routed to (top-k of the router's softmax)
    moe_intermediate_size: int = 0             # an expert's MLP width
    norm_topk_prob: bool = False               # the chosen experts' weights renormalized to sum to 1
    sparse_layers: tuple[int, ...] = ()        # the layers whose MLP is the experts; the others dense
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE: a dense expert every token takes, behind a sigmoid gate
    expert_names: str = "qwen"                 # the checkpoint's names: "qwen" (mlp.experts.j.gate_proj),
                                               # "mixtral" (block_sparse_moe.experts.j.w1 / w3 / w2)
    router_weights_fp32: bool = False          # Mixtral: the routing weights stay fp32 in the combine
    # sliding windows (Gemma 3, Mistral's sliding_window, Qwen's use_sliding_window): per layer the keys a query
    # sees, its own included (0: every key before it); empty: every layer full
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None      # the windowed layers' RoPE base (Gemma 3: 10K; the full ones rope_theta)
    attention_scale: float | None = None       # the softmax's scale (Gemma 3: query_pre_attn_scalar^-0.5); None: D^-0.5
    gemma: bool = False                        # Gemma's decoder: RMSNorms scale by (1 + w), a norm after attention and
                                               # before and after the MLP, GeGLU (tanh GELU), the embedding times
                                               # sqrt(hidden)

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the experts."""
        return layer in self.sparse_layers

    def window(self, layer: int) -> int | None:
        """The keys layer `layer`'s queries see (their own included), or None: every key before them."""
        return (self.layer_windows[layer] or None) if self.layer_windows else None

    @property
    def has_windows(self) -> bool:
        return any(self.layer_windows)

    @property
    def scale(self) -> float:
        """The attention softmax's scale."""
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5


def load_model_config(model_dir: str) -> ModelConfig:
    """Reads `model_dir/config.json`; raises ModelLoadError naming what is missing or unsupported."""
    if not os.path.isdir(model_dir):
        raise ModelLoadError(unknown_model(model_dir))
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"model directory {model_dir!r} has no config.json (expected at {path})")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    return config_from_hf_dict(raw, source=path)


def unknown_model(model: str) -> str:
    """Why `model` names nothing, with the nearest name it may have meant: a preset, a packaged model, or an
    entry of the folder the path points into."""
    why = (f"model {model!r} is neither a preset ({', '.join(preset_names())}), a trained model a package carries "
           f"({', '.join(PACKAGED_MODELS)}) nor a directory")
    guess = difflib.get_close_matches(model.lower(), [*preset_names(), *PACKAGED_MODELS], n=1, cutoff=0.75)
    folder = os.path.dirname(model)
    if not guess and folder and os.path.isdir(folder):
        near = difflib.get_close_matches(os.path.basename(model), sorted(os.listdir(folder)), n=1, cutoff=0.75)
        guess = [os.path.join(folder, name) for name in near]
    return why + (f"; did you mean {guess[0]!r}?" if guess else "")


def config_from_hf_dict(raw: dict, source: str = "config") -> ModelConfig:
    archs = raw.get("architectures") or [_arch_from_model_type(raw.get("model_type"))]
    arch = archs[0]
    if arch == "Gemma3ForConditionalGeneration":   # a vision-language Gemma 3: its text model (weights: weights.py)
        return config_from_hf_dict({**raw["text_config"], "architectures": ["Gemma3ForCausalLM"]}, source)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise ModelLoadError(f"{source}: attention_bias / mlp_bias on {arch} is not supported")
    heads = raw["num_attention_heads"]
    gemma = arch == "Gemma3ForCausalLM"
    local_theta = None
    if gemma:
        local_theta = _gemma_checks(raw, source)
        raw = {**raw, "rope_parameters": (raw.get("rope_parameters") or {}).get("full_attention") or raw.get("rope_scaling")}
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{source}: rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    rope["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):    # the pretraining length, where transformers finds it
        rope["original_max_position_embeddings"] = (raw.get("original_max_position_embeddings")
                                                    or rope.get("original_max_position_embeddings")
                                                    or raw.get("max_position_embeddings", 4096))
    if rope_type == "yarn" and rope.get("factor") is None:
        rope["factor"] = raw.get("max_position_embeddings", 4096) / rope["original_max_position_embeddings"]
    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=float(theta),
        rope_scaling=None if rope_type == "default" else rope,
        qkv_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        layer_windows=layer_windows(arch, raw),
        local_rope_theta=local_theta,
        attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        gemma=gemma,
        **(_experts(arch, raw, source) if arch in MOE_ARCHITECTURES else {}),
    )


def layer_windows(arch: str, raw: dict) -> tuple[int, ...]:
    """Per layer its sliding window (0: full), as transformers reads the config: `layer_types` where it names
    them ("sliding_attention"); else Gemma 3 every layer but each sliding_window_pattern-th (6), Mistral and
    Mixtral every layer, Qwen with use_sliding_window the layers from max_window_layers on. A window as long as
    the model's context changes nothing and is not kept."""
    window = raw.get("sliding_window") or 0
    layers = raw["num_hidden_layers"]
    if not window or window >= raw.get("max_position_embeddings", 1 << 62):
        return ()
    if raw.get("layer_types"):
        kinds = [kind == "sliding_attention" for kind in raw["layer_types"]]
    elif arch == "Gemma3ForCausalLM":
        pattern = raw.get("sliding_window_pattern", 6)
        kinds = [bool((i + 1) % pattern) for i in range(layers)]
    elif arch.startswith("Qwen"):
        kinds = [bool(raw.get("use_sliding_window")) and i >= raw.get("max_window_layers", 28) for i in range(layers)]
    else:
        kinds = [True] * layers
    return tuple(window if k else 0 for k in kinds) if any(kinds) else ()


def _gemma_checks(raw: dict, source: str) -> float:
    """What the engine's Gemma 3 does not compute, refused by name -> the windowed layers' RoPE base."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise ModelLoadError(f"{source}: Gemma 3 with {key}={raw[key]} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: Gemma 3 with use_bidirectional_attention is not supported (a causal LM only)")
    if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{source}: Gemma 3's hidden_activation {raw['hidden_activation']!r} is not supported")
    local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{source}: Gemma 3's windowed layers with rope type {local['rope_type']!r} are not supported")
    return float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0)


def _experts(arch: str, raw: dict, source: str) -> dict:
    """ModelConfig's mixture-of-experts fields of a Qwen3-MoE, Mixtral or Qwen2-MoE config.json (transformers
    5 writes num_local_experts where the released checkpoints say num_experts). Which layers are sparse
    follows transformers: Mixtral every one; the Qwen families every decoder_sparse_step-th, less
    mlp_only_layers."""
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    layers = raw["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        return dict(num_experts=experts, num_experts_per_tok=raw.get("num_experts_per_tok", 2),
                    moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
                    sparse_layers=tuple(range(layers)), expert_names="mixtral", router_weights_fp32=True)
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu)")
    step, dense = raw.get("decoder_sparse_step") or 1, set(raw.get("mlp_only_layers") or ())
    return dict(num_experts=experts, num_experts_per_tok=raw["num_experts_per_tok"],
                moe_intermediate_size=raw["moe_intermediate_size"], norm_topk_prob=bool(raw.get("norm_topk_prob")),
                sparse_layers=tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0),
                shared_expert_intermediate_size=(raw.get("shared_expert_intermediate_size") or 0)
                if arch == "Qwen2MoeForCausalLM" else 0)


def _arch_from_model_type(model_type: str | None) -> str:
    for arch, mt in SUPPORTED_ARCHITECTURES.items():
        if mt == model_type:
            return arch
    return str(model_type)


# Presets: random weights, real shapes, a byte-level tokenizer (ids 0-255 bytes, 256 BOS, 257 EOS).
_GEMMA3 = dict(rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}, local_rope_theta=10000.0,
               max_position_embeddings=131072, rms_norm_eps=1e-6, qk_norm=True, tie_word_embeddings=True, gemma=True)
PRESET_MAX_MODEL_LEN = 1 << 20
_PRESETS = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=32, rope_theta=500000.0, max_position_embeddings=8192),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                      num_heads=32, num_kv_heads=32, head_dim=128, rope_theta=10000.0, max_position_embeddings=4096),
    "llama2-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40,
                       num_heads=40, num_kv_heads=40, head_dim=128, rope_theta=10000.0, max_position_embeddings=4096),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192),
    # about 141 GB in bf16: more than one GPU holds; serve with --sp-strategy tp over enough GPUs
    "llama2-70b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80,
                       num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=10000.0, max_position_embeddings=4096),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                       num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192),
    # mixtures of experts (engine/model/moe.py), their released configs' shapes
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                          num_kv_heads=4, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
                          rms_norm_eps=1e-6, qk_norm=True, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, sparse_layers=tuple(range(48))),
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=1000000.0, max_position_embeddings=32768,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
                         sparse_layers=tuple(range(32)), expert_names="mixtral", router_weights_fp32=True),
    # about 470 GB in bf16: for memory planning; more than any one GPU holds (refused with the figures)
    "qwen3-235b-a22b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=94, num_heads=64,
                            num_kv_heads=4, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
                            rms_norm_eps=1e-6, qk_norm=True, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=1536, norm_topk_prob=True, sparse_layers=tuple(range(94))),
    # Gemma 3 (text; gemma_pytorch's shapes): windows of 1024 in five layers of six, the full layers' RoPE x8 linear
    "gemma3-4b": dict(vocab_size=262144, hidden_size=2560, intermediate_size=10240, num_layers=34, num_heads=8,
                      num_kv_heads=4, head_dim=256, **_GEMMA3),
    "gemma3-27b": dict(vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_layers=62, num_heads=32,
                       num_kv_heads=16, head_dim=128, attention_scale=168 ** -0.5, **_GEMMA3),
}
for _name in ("gemma3-4b", "gemma3-27b"):
    _PRESETS[_name]["layer_windows"] = tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(_PRESETS[_name]["num_layers"]))


def preset_names() -> list[str]:
    return list(_PRESETS)


def preset_config(name: str) -> ModelConfig:
    return ModelConfig(**{"rms_norm_eps": 1e-5, **_PRESETS[name]}, bos_token_id=256, eos_token_ids=[257])


# Chunked prefill's default chunk, per worker a prompt is sharded over: large enough that a lone long prompt
# keeps its unchunked time to first token, small enough that the KV pool is not held back for a whole
# prompt's activations; while others decode, the chunk sizer (engine/scheduler/chunk_sizer.py) cuts chunks to the ITL
# target anyway. A chunk is sharded over the workers like a prompt, so the default grows with them (tp: every
# worker runs the whole chunk, one share), up to DEFAULT_CHUNK_WORKERS_MAX workers' worth: a worker reserves
# memory for a whole chunk's rows (a ring extend levels the workers' totals, so after an uneven prefix one
# worker can run nearly all of it) and for its pass-Q (engine/pages/sizing.py), both growing with the chunk,
# not the share. How it was chosen: docs/benchmarks.md, "Chunked prefill and interference" and "Prefill on two
# GPUs, default flags".
DEFAULT_CHUNK_TOKENS_PER_WORKER = 65536
DEFAULT_CHUNK_WORKERS_MAX = 2


MIN_CHUNK = 256          # on a GPU smaller chunks read the weights for too little work (and launch as many kernels)
MIN_CHUNK_CPU = 32       # on a CPU a call's fixed cost is small beside its attention, so small chunks cost little


def default_chunk_tokens(sequence_workers: int) -> int:
    """--max-num-batched-tokens' default on an engine whose prompts are sharded over `sequence_workers`
    workers (the strategy's kv_workers: 1 on one worker or under tp): 65536, 131072 on two or more."""
    return DEFAULT_CHUNK_TOKENS_PER_WORKER * min(sequence_workers, DEFAULT_CHUNK_WORKERS_MAX)


@dataclass
class EngineConfig:
    """What the engine was asked to run; built once by `LLM` (engine/options.py engine_config) and sent to
    every worker. A field's default is also the default of the engine option of its name (OPTIONS), unless
    the option names its own (dtype's: None, chosen by device)."""
    model: str                      # a preset name or a local directory
    devices: list[str]              # one torch device per worker, e.g. ["cuda:0", "cuda:1"]
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    sp_strategy: str = "burst"
    auto_ulysses_max_tokens: int = 16384    # sp_strategy "auto": prompts up to this length use ulysses, longer burst
    zero_sliced_max_tokens: int | None = None   # burst-zero: prompts up to this length run on the weight slices
                                            # (engine/parallel/zero_sliced.py); None: measured at start on GPUs
    overlap: bool = True
    seed: int = 0
    kernel: str = "auto"
    kv_cache_tokens: int | None = None      # per worker; None: sized from gpu_memory_utilization (engine/pages/sizing.py)
    gpu_memory_utilization: float = 0.9     # share of each GPU's memory for weights, activations and the KV pool
    block_size: int | None = None           # tokens per KV page; None: 128 on GPUs, 16 on CPU
    cuda_graphs: bool = True                # decode steps replayed as CUDA graphs where they can be (GPU, flash-attn-4)
    async_scheduling: bool = True           # a decode step launched before the host reads the last one's tokens
                                            # (engine/scheduler/decode_steps.py DecodeSteps.ahead)
    enable_prefix_caching: bool = True      # finished sequences stay in the KV cache; a prompt reuses their prefix
    max_num_batched_tokens: int | None = None   # a longer prompt is prefilled in chunks of at most this many
                                                # tokens (decode steps run between them), a shorter one too when
                                                # one call would pass itl_target_ms while others decode; None: every
                                                # prompt in one call. LLM's default: default_chunk_tokens
    quantization: str = "none"              # "fp8": linear weights in FP8, per-channel scales (kernels/fp8.py)
    kv_cache_dtype: str = "auto"            # "fp8": K/V pages in FP8, a scale per token and head (kernels/kv_quant.py)
    kv_offload_gb: float | None = None      # per worker: GiB of host memory under the prefix cache (engine/cache/
                                            # host_pool.py); 0 or None: none (LLM resolves None by device:
                                            # engine/pages/host_memory.py offload_gib)
    itl_target_ms: float | None = 50.0      # while others decode, a chunk + their step is sized to this (None: chunks
                                            # of max_num_batched_tokens always; engine/scheduler/chunk_sizer.py)
    extend_ring_min_tokens: int = 4096      # on several workers, an incremental prefill of at least this many new
                                            # tokens is sharded over them (K/V ring + pass-Q); fewer run whole on
                                            # every worker, one keeping their K/V (engine/runner/extend_attention.py)
    extend_pass: str = "kv"                 # a sharded extend's cached tokens: "kv" passes their K/V around the ring
                                            # (engine/parallel/pass_kv.py; FP8 pages, or blocks that do not fit: "q"),
                                            # "q" the new queries to them
    mixed_batch: bool | None = None         # a chunk after the first and the running sequences' decode step in
                                            # one forward pass (weights read once). None (auto): where the worker
                                            # replays it as CUDA graphs (engine/runner/extend_graphs.py); eagerly the
                                            # decode half made a late 256-token chunk host-bound (docs/benchmarks.md)

    @property
    def page_size(self) -> int:
        return self.block_size or (128 if self.devices[0].startswith("cuda") else 16)

    @property
    def is_preset(self) -> bool:
        return self.model in _PRESETS

    @property
    def world_size(self) -> int:
        return len(self.devices)


def context_limit(cfg: ModelConfig) -> int:
    """The longest context a checkpoint is made for: max_position_embeddings, or for YaRN its pretraining
    length times the factor (as vLLM derives it: Qwen2.5's 32768 x 4 = 131072)."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "yarn":
        return int(scaling["original_max_position_embeddings"] * scaling["factor"])
    return cfg.max_position_embeddings


def resolve_model(engine: EngineConfig) -> tuple[ModelConfig, int]:
    """Returns the model's config and the effective max_model_len; raises ModelLoadError."""
    if engine.dtype not in DTYPES:
        raise ModelLoadError(f"dtype {engine.dtype!r} is not one of {', '.join(DTYPES)}")
    if engine.is_preset:
        cfg = preset_config(engine.model)
        limit = PRESET_MAX_MODEL_LEN
    else:
        cfg = load_model_config(engine.model)
        limit = context_limit(cfg)
    if cfg.has_windows and not all(d.startswith("cpu") for d in engine.devices):
        raise ModelLoadError(f"{engine.model}: sliding-window attention (windows of {max(cfg.layer_windows)} tokens) "
                             "runs on CPU workers only so far: its GPU kernels are not built yet")
    max_len = engine.max_model_len or limit
    if max_len < 1:
        raise ModelLoadError(f"max_model_len must be positive, got {max_len}")
    return cfg, max_len

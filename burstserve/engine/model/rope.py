"""Rotary position embeddings: default, linear, LLaMA-3's frequency-dependent scaling and YaRN (NTK-by-parts
frequencies and a scale on cos/sin), each as transformers computes it for the same config."""
import math

import torch

from burstserve.engine.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] fp32, as transformers computes them for this config."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_frequencies(inv_freq, scaling, cfg.rope_theta, d)
    return inv_freq


def attention_scaling(cfg: ModelConfig) -> float:
    """The factor on cos and sin (1 but for YaRN: its attention_factor, else 0.1 ln(factor) + 1, with
    DeepSeek's mscale / mscale_all_dim ratio where both are given)."""
    s = cfg.rope_scaling or {}
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(s["factor"], s["mscale"]) / mscale(s["factor"], s["mscale_all_dim"]))
    return mscale(s["factor"])


def _yarn_frequencies(inv_freq: torch.Tensor, s: dict, base: float, d: int) -> torch.Tensor:
    """YaRN: the fast-rotating dimensions keep their frequency (extrapolation), the slow ones are divided by
    the factor (interpolation), with a linear ramp between the dimensions that turn beta_fast and beta_slow
    times over the pretraining length."""
    old_len = s["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:           # the dimension that turns `rotations` times over old_len
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)   # 0: keep, 1: scale
    return inv_freq / s["factor"] * ramp + inv_freq * (1 - ramp)


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                 scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [S] int -> cos, sin [S, head_dim] in dtype (computed in fp32, times `scaling`: see
    attention_scaling); rotate with kernels.fused.rope_."""
    freqs = positions.float()[:, None] * inv_freq[None, :]            # [S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                            # [S, D]
    if scaling != 1.0:
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)

"""RoPE frequencies and the cos/sin scale from a checkpoint's config.json, against transformers' own
(`ROPE_INIT_FUNCTIONS`) on the same config: default, linear, llama3 and YaRN in its variants (Qwen2.5's
settings, DeepSeek's mscale pair, a given attention_factor, no truncation, the factor left to the
lengths, the pretraining length outside rope_scaling); the context a YaRN checkpoint allows; and the
rope types that stay refused, with what is supported."""
import random

import pytest
import torch

from burstserve.engine import ModelLoadError
from burstserve.engine.model.config import config_from_hf_dict, context_limit
from burstserve.engine.model.rope import attention_scaling, inverse_frequencies

SHAPE = dict(vocab_size=320, hidden_size=512, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32768)     # head_dim 128, as the real models

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn (Qwen2.5's, old 'type' key)": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn, mscale pair": YARN | {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                                 "original_max_position_embeddings": 4096, "beta_fast": 24, "beta_slow": 2},
    "yarn, attention_factor given": YARN | {"attention_factor": 1.3},
    "yarn, no truncation": YARN | {"truncate": False, "original_max_position_embeddings": 3000},
    "yarn, factor 1": YARN | {"factor": 1.0},
}


def _hf_config(arch: str, rope: dict | None, theta: float):
    from transformers import LlamaConfig, Qwen2Config
    make = Qwen2Config if arch == "Qwen2ForCausalLM" else LlamaConfig
    return make(**SHAPE, rope_theta=theta, **({"rope_scaling": dict(rope)} if rope else {}))


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_frequencies_and_scale_are_transformers(name, arch):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    theta = random.choice([10000.0, 1000000.0])
    hf = _hf_config(arch, ROPES[name], theta)
    cfg = config_from_hf_dict(hf.to_dict() | {"architectures": [arch]})
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        want = 1.0 / (theta ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
        want_scale = 1.0
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"))
    got = inverse_frequencies(cfg)
    assert got.shape == want.shape == (64,)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert attention_scaling(cfg) == pytest.approx(want_scale, rel=1e-9), name
    if kind == "yarn":                                # the frequencies are a real mix, not one of the ends
        base = 1.0 / (theta ** (torch.arange(0, 128, 2).float() / 128))
        factor = hf.rope_parameters["factor"]
        if factor > 1:
            assert torch.equal(got[0], base[0]) and torch.isclose(got[-1], base[-1] / factor)


def test_yarn_sets_the_context_limit_and_fills_in_what_transformers_would():
    raw = _hf_config("Qwen2ForCausalLM", YARN, 1e6).to_dict() | {"architectures": ["Qwen2ForCausalLM"]}
    assert context_limit(config_from_hf_dict(raw)) == 131072          # 32768 x 4, as vLLM derives it
    plain = config_from_hf_dict(_hf_config("LlamaForCausalLM", None, 1e4).to_dict() | {"architectures": ["LlamaForCausalLM"]})
    assert context_limit(plain) == 32768
    # no original length in rope_scaling: max_position_embeddings is it; no factor: the ratio of the two
    bare = dict(raw, rope_scaling={"rope_type": "yarn", "factor": 2.0}, rope_parameters=None)
    cfg = config_from_hf_dict(bare)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32768 and context_limit(cfg) == 65536
    top = dict(bare, original_max_position_embeddings=8192, rope_scaling={"rope_type": "yarn", "factor": None})
    cfg = config_from_hf_dict(top)
    assert cfg.rope_scaling["factor"] == 4.0 and context_limit(cfg) == 32768


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "su"])
def test_other_rope_types_are_refused_by_name(kind):
    raw = _hf_config("LlamaForCausalLM", None, 1e4).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    raw["rope_scaling"] = {"rope_type": kind, "factor": 2.0}
    raw.pop("rope_parameters", None)
    with pytest.raises(ModelLoadError, match=f"rope type '{kind}' is not supported .default, linear, llama3, yarn."):
        config_from_hf_dict(raw, source="config.json")

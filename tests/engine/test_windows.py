"""Sliding-window attention (ModelConfig.layer_windows): Gemma 3, Mistral with its sliding_window and Qwen2 with
use_sliding_window, against transformers on the same saved random checkpoints, in fp32 on one CPU worker. Prompts
several windows long, whole, in chunks shorter than the window and after a prefix hit; the window must change the
answer (transformers without it disagrees); what is not built yet (several workers, GPUs) refused by name; the
windowed kernel against a brute-force sum."""
import dataclasses
import random

import pytest
import torch

from burstserve.engine import LLM, SamplingParams
from burstserve.engine.core.errors import InvalidRequestError, ModelLoadError
from burstserve.engine.model.config import EngineConfig, load_model_config, resolve_model
from burstserve.kernels.attention import windowed_attention
from hf_reference import assert_same_greedy, hf_next_logits_and_greedy, save_checkpoint

KINDS = ["gemma3", "mistral-window", "qwen2-window"]
NUM_TOKENS = 10


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    model = save_checkpoint(request.param, path, seed=random.randrange(1 << 30))
    return request.param, path, model


def test_the_windows_are_the_models(checkpoint):
    """Which layers see a window, and how wide, as transformers builds them; Gemma's own RoPE base and scale."""
    kind, path, model = checkpoint
    cfg = load_model_config(path)
    window = model.config.sliding_window                           # Mistral's layers read it from the config
    want = tuple(getattr(layer.self_attn, "sliding_window", window) or 0 for layer in model.model.layers)
    assert cfg.layer_windows == want and any(want), (kind, cfg.layer_windows, want)
    if kind == "gemma3":
        assert cfg.gemma and cfg.local_rope_theta == 10000.0 and cfg.rope_theta == 1e6
        assert cfg.scale == model.model.layers[0].self_attn.scaling and cfg.tie_word_embeddings


def _prompts(vocab: int, window: int) -> list[list[int]]:
    """Prompts of 1 token, just under the window, and three windows and more."""
    return [[random.randrange(vocab) for _ in range(n)] for n in (1, window - 1, 3 * window + random.randrange(9))]


@pytest.mark.parametrize("chunked", [False, True])
def test_the_engine_matches_transformers(checkpoint, chunked):
    """The next token's logits after each prompt and the greedy continuation (decode steps past the window), the
    prompt in one call or in chunks shorter than the window."""
    kind, path, model = checkpoint
    window = max(load_model_config(path).layer_windows)
    options = dict(max_num_batched_tokens=32) if chunked else dict(enable_chunked_prefill=False)
    assert not chunked or 32 < window
    prompts = _prompts(model.config.vocab_size, window)
    with LLM(path, devices="cpu", dtype="float32", **options) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
        for prompt, out in zip(prompts, outputs):
            want_logits, want_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
            diff = (llm.next_token_logits(prompt) - want_logits).abs().max().item()
            assert diff <= 1e-4, f"{kind}: {len(prompt)} tokens, logits differ by {diff}"
            assert_same_greedy(model, prompt, out.outputs[0].token_ids, want_tokens, (kind, len(prompt)))
            if chunked and len(prompt) > window:
                assert out.metrics.prefill_stats.chunks > 1, out.metrics.prefill_stats


@pytest.mark.parametrize("strategy", ["tp", "tp-v3"])
def test_tensor_parallel_workers_match_transformers(checkpoint, strategy):
    """tp and tp-v3 on two workers (each holds every position of its heads): whole prompts and chunks shorter than
    the window give transformers' logits and greedy tokens."""
    kind, path, model = checkpoint
    window = max(load_model_config(path).layer_windows)
    prompts = _prompts(model.config.vocab_size, window)
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", sp_strategy=strategy,
             max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
        for prompt, out in zip(prompts, outputs):
            want_logits, want_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
            diff = (llm.next_token_logits(prompt) - want_logits).abs().max().item()
            assert diff <= 1e-4, f"{kind}, {strategy}: {len(prompt)} tokens, logits differ by {diff}"
            assert_same_greedy(model, prompt, out.outputs[0].token_ids, want_tokens, (kind, strategy, len(prompt)))


def test_a_prefix_hit_matches_transformers_and_the_window_changes_the_answer(checkpoint):
    """A prompt three windows long, then one sharing most of it (its K/V copied from the prefix cache, the rest
    extended): each one's next-token logits and greedy tokens are transformers'. transformers with every window
    opened up disagrees on the long prompt: the window is what the engine computes."""
    kind, path, model = checkpoint
    window = max(load_model_config(path).layer_windows)
    vocab = model.config.vocab_size
    first = [random.randrange(vocab) for _ in range(3 * window + 20)]
    second = first[:2 * window + 16] + [random.randrange(vocab) for _ in range(window // 2)]
    with LLM(path, devices="cpu", dtype="float32", block_size=4) as llm:
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outs = [llm.generate([p], params)[0] for p in (first, second)]
        assert outs[1].metrics.prefill_stats.cached_tokens >= 2 * window, outs[1].metrics.prefill_stats
        got = []
        for prompt, out in zip((first, second), outs):
            want_logits, want_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
            got.append(llm.next_token_logits(prompt))
            diff = (got[-1] - want_logits).abs().max().item()
            assert diff <= 1e-4, f"{kind}, {len(prompt)} tokens after a prefix hit: logits differ by {diff}"
            assert_same_greedy(model, prompt, out.outputs[0].token_ids, want_tokens, (kind, len(prompt)))
    opened = type(model)(dataclasses.replace(model.config, sliding_window=1 << 20)).eval()
    opened.load_state_dict(model.state_dict())
    with torch.no_grad():
        full = opened(torch.tensor([first])).logits[0, -1].float()
    assert (full - got[0]).abs().max().item() > 1e-2, "the windows changed nothing: the test cannot tell them"


def test_fp8_pages_match_transformers_with_kv_rounded_alike(checkpoint):
    """FP8 pages (K/V rounded as the cache keeps them, every attention reading them so): a prompt three windows
    long in chunks shorter than the window, and decode past it, give the logits and greedy tokens of transformers
    whose K/V are rounded alike."""
    from burstserve.kernels.kv_quant import round_kv
    from hf_reference import kv_rounded
    kind, path, model = checkpoint
    window = max(load_model_config(path).layer_windows)
    prompt = [random.randrange(model.config.vocab_size) for _ in range(3 * window + 5)]
    with LLM(path, devices="cpu", dtype="float32", kv_cache_dtype="fp8", max_num_batched_tokens=32) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))[0]
        got_logits = llm.next_token_logits(prompt)
    plain, _ = hf_next_logits_and_greedy(model, prompt, 1)
    with kv_rounded(model, round_kv):
        want_logits, want_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
        diff = (got_logits - want_logits).abs().max().item()
        # test_fp8_kv_cache.py's bound (5e-3: fp32 noise, but where a K/V element lies within it of an FP8 rounding
        # midpoint and rounds the other way, one step, 6%, on one element), or 2% of the rounding's own effect: a
        # random Gemma's norm after attention scales attention's error up (the rounding itself moved its logits
        # by 0.96-1.46 of 1.8-2.0, against 0.04-0.08 in the Llama family's; the engine 0.0014-0.0137 from the
        # reference that rounds alike)
        rounding = (got_logits - plain).abs().max().item()
        bound = max(5e-3, 0.02 * rounding)
        assert 1e-3 < rounding and diff <= bound, f"{kind}: FP8 pages, logits differ by {diff}"
        # greedy tokens may part where the reference rates the two within twice that (each side's error)
        assert_same_greedy(model, prompt, out.outputs[0].token_ids, want_tokens, (kind, "fp8"), 2 * bound)


def test_what_is_not_built_yet_is_refused_by_name(checkpoint):
    """A windowed model under a strategy that shards the sequence over several workers, or on a GPU (its kernels
    take no window yet), is refused before any worker starts, naming the window."""
    kind, path, model = checkpoint
    window = max(load_model_config(path).layer_windows)
    for strategy in ("burst", "ulysses", "burst-zero"):
        with pytest.raises(InvalidRequestError, match=f"sliding-window attention \\(windows of {window} tokens\\) "
                                                      f"runs on one worker or under --sp-strategy tp / tp-v3 so far; "
                                                      f"{strategy} shards the sequence over 2 workers"):
            LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", sp_strategy=strategy)
    with pytest.raises(ModelLoadError, match="runs on CPU workers only so far"):
        resolve_model(EngineConfig(model=path, devices=["cuda:0"]))


def test_the_windowed_kernel_is_the_sum_over_each_querys_window():
    """windowed_attention against a direct softmax over each query's window (fp64), end-aligned queries, a window
    wider than the keys, grouped heads, query chunks smaller than the window."""
    hkv, g = random.choice([(1, 4), (2, 2)])
    d = 8
    n, m, window = random.randrange(20, 60), random.randrange(1, 20), random.randrange(1, 70)
    q, k, v = torch.randn(m, hkv * g, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    scale = random.uniform(0.1, 0.5)
    out, lse = windowed_attention(q, k, v, scale, window, query_chunk=random.randrange(1, 8))
    for i in range(m):
        pos = n - m + i
        keys = torch.arange(max(0, pos - window + 1), pos + 1)
        for h in range(hkv * g):
            scores = (k[keys, h // g].double() @ q[i, h].double()) * scale
            probs = torch.softmax(scores, 0)
            torch.testing.assert_close(out[i, h].double(), probs @ v[keys, h // g].double(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[i, h].double(), torch.logsumexp(scores, 0), atol=1e-5, rtol=1e-5)


def test_the_gemma_presets_have_the_released_text_models_sizes():
    """gemma3-4b and gemma3-27b: their text models' parameter counts (3.88B, 27.0B; the vision towers are not
    served) within 0.5%, five windowed layers of 1024 for each full one, the full layers' RoPE scaled x8."""
    import math
    from burstserve.engine.model.config import preset_config
    from burstserve.engine.model.model import hf_weight_shapes
    for name, billions in (("gemma3-4b", 3.88), ("gemma3-27b", 27.0)):
        cfg = preset_config(name)
        count = sum(math.prod(shape) for shape in hf_weight_shapes(cfg).values()) / 1e9
        assert abs(count - billions) / billions < 5e-3, (name, count)
        assert cfg.gemma and cfg.layer_windows[:6] == (1024,) * 5 + (0,) and cfg.rope_scaling["factor"] == 8.0


def test_the_language_model_of_a_vision_language_gemma_3_is_served(tmp_path):
    """Gemma 3's 4B, 12B and 27B releases are Gemma3ForConditionalGeneration checkpoints: the engine serves their
    language model (text_config; tensors under language_model.), whose logits on a text prompt are transformers'
    whole model's, the vision tower unread."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig
    from hf_reference import TINY_SHAPE
    torch.manual_seed(random.randrange(1 << 30))
    text = Gemma3TextConfig(**dict(TINY_SHAPE, num_hidden_layers=3), num_key_value_heads=1, head_dim=32,
                            sliding_window=12, sliding_window_pattern=3)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                        mm_tokens_per_image=4)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(tmp_path))
    assert load_model_config(str(tmp_path)).layer_windows == (12, 12, 0)
    prompt = [random.randrange(300) for _ in range(40)]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    with LLM(str(tmp_path), devices="cpu", dtype="float32") as llm:
        diff = (llm.next_token_logits(prompt) - want).abs().max().item()
    assert diff <= 1e-4, diff

"""The engine's logits and greedy tokens equal transformers' on the same checkpoint (CPU, fp32),
for 1-4 workers and prompt lengths 1, 2G-1, 37 and 1000 (zigzag shards, empty workers, uneven chunks)."""
import random

import pytest
import torch

from burstserve.engine import LLM, SamplingParams
from hf_reference import hf_next_logits_and_greedy, save_checkpoint

KINDS = ["llama-mha", "llama3-gqa", "qwen2", "qwen3"]
NUM_TOKENS = 32


# Chunked prefill off: each prompt is prefilled whole by the strategy under test (with it on, a prompt that
# arrives while others decode may be chunked, its later chunks run as incremental prefills).
WHOLE = dict(enable_chunked_prefill=False)


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    model = save_checkpoint(request.param, path, seed=random.randrange(1 << 30))
    return path, model, {}


def _reference(checkpoint, prompt):
    path, model, cache = checkpoint
    key = tuple(prompt)
    if key not in cache:
        cache[key] = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
    return cache[key]


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_logits_and_greedy_tokens_match_transformers(checkpoint, workers):
    path, model, _ = checkpoint
    vocab = model.config.vocab_size
    lengths = sorted({1, 2 * workers - 1, 37, 1000})
    prompts = [[random.randrange(vocab) for _ in range(n)] for n in lengths]
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32") as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
        for prompt, out in zip(prompts, outputs):
            ref_logits, ref_tokens = _reference(checkpoint, prompt)
            logits = llm.next_token_logits(prompt)
            diff = (logits - ref_logits).abs().max().item()
            assert diff <= 1e-4, f"{len(prompt)} tokens on {workers} workers: logits differ by {diff}"
            assert out.outputs[0].token_ids == ref_tokens, f"{len(prompt)} tokens on {workers} workers"
            assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("strategy", ["tp", "tp-v3", "burst-zero", "burst-zero-sliced"])
def test_tensor_parallel_over_sliced_weights_matches_transformers(checkpoint, strategy):
    """tp and tp-v3 (Megatron V1 and V3) and burst-zero (BurstAttention+ZeRO: the burst ring over layers
    gathered whole from tp's slices, decode on the slices) on 2 workers, each reading only its slice of
    the weights: the same logits, greedy tokens and decoded tokens' logprobs (top 2 and the chosen) on
    every checkpoint shape (MHA, GQA, Qwen2's q/k/v biases, Qwen3's norms on q and k). burst-zero-sliced: burst-zero with prompts
    up to 500 tokens run on the slices (engine/parallel/zero_sliced.py), so the 1000-token one is gathered."""
    path, model, _ = checkpoint
    vocab = model.config.vocab_size
    prompts = [[random.randrange(vocab) for _ in range(n)] for n in (1, 37, 1000)]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)
    options = ({"sp_strategy": "burst-zero", "zero_sliced_max_tokens": 500} if strategy == "burst-zero-sliced"
               else {"sp_strategy": strategy})
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", **WHOLE, **options) as llm:
        outputs = llm.generate(prompts, params)
        ways = [o.metrics.prefill_stats.strategy for o in outputs]
        if strategy == "burst-zero-sliced":
            assert ways == ["burst-zero-sliced", "burst-zero-sliced", "burst-zero"], ways
        for prompt, out in zip(prompts, outputs):
            ref_logits, ref_tokens = _reference(checkpoint, prompt)
            diff = (llm.next_token_logits(prompt) - ref_logits).abs().max().item()
            assert diff <= 1e-4, f"{strategy}, {len(prompt)} tokens: logits differ by {diff}"
            assert out.outputs[0].token_ids == ref_tokens, f"{strategy}, {len(prompt)} tokens"
            with torch.no_grad():                                  # every decoded token's logprobs, one full pass
                ids = torch.tensor([prompt + ref_tokens[:-1]])
                ref_logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:].float(), dim=-1)   # [32, V]
            for i, entry in enumerate(out.outputs[0].logprobs):
                for token, logprob in entry.items():
                    assert abs(logprob - ref_logp[i, token].item()) <= 1e-4, (strategy, len(prompt), i, token)


@pytest.mark.parametrize("kind,workers", [("qwen2-yarn", 1), ("qwen2-yarn", 3), ("qwen3-yarn", 2)])
def test_yarn_checkpoint_matches_transformers(tmp_path, kind, workers):
    """A Qwen2 (and a Qwen3) checkpoint with YaRN RoPE scaling (x4 over 512 pretraining tokens: frequencies
    mixed per dimension, cos and sin scaled by 0.1 ln 4 + 1): logits and greedy tokens are transformers' on
    prompts within and past the pretraining length, and the engine allows 512 x 4 tokens of context."""
    model = save_checkpoint(kind, str(tmp_path), seed=random.randrange(1 << 30))
    vocab = model.config.vocab_size
    prompts = [[random.randrange(vocab) for _ in range(n)] for n in (37, 1000)]
    with LLM(str(tmp_path), devices="cpu", context_parallel_size=workers, dtype="float32") as llm:
        assert llm.max_model_len == 2048
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
        for prompt, out in zip(prompts, outputs):
            ref_logits, ref_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
            diff = (llm.next_token_logits(prompt) - ref_logits).abs().max().item()
            assert diff <= 1e-4, f"{len(prompt)} tokens on {workers} workers: logits differ by {diff}"
            assert out.outputs[0].token_ids == ref_tokens, f"{len(prompt)} tokens on {workers} workers"


def test_a_max_model_len_past_what_the_checkpoint_is_made_for_is_warned(tmp_path, caplog):
    """YaRN x4 over 512 tokens allows 2048; asking for 4096 starts (as vLLM's override would) with a warning
    naming both numbers."""
    save_checkpoint("qwen2-yarn", str(tmp_path), seed=random.randrange(1 << 30))
    with caplog.at_level("WARNING", logger="burstserve.engine.llm"):
        with LLM(str(tmp_path), devices="cpu", dtype="float32", max_model_len=4096) as llm:
            assert llm.max_model_len == 4096
    assert any("max_model_len 4096 is longer than the 2048 tokens" in r.getMessage() for r in caplog.records), \
        caplog.text

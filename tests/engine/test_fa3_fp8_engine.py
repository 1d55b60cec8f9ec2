"""--attention-backend fa3-fp8 (kernels/fa3_fp8.py): FP8 attention in the engine's prefill, on CPU workers
(the torch path of FlashAttention-3's arithmetic).

The reference is transformers on the same checkpoint with its attention replaced by FA3's FP8 arithmetic
(hf_reference.fa3_like_reference, written apart from the engine's): on one worker a one-call prefill rounds
the same operands (the whole prompt's q, k, v) and the logits equal it within fp32's midpoint flips. Where the
engine cuts the attention otherwise (a ring's blocks, chunks against cached pages, FP8 pages), each call rounds
its own operands: there the logits differ from transformers unrounded by FP8's rounding (more than 1e-3,
within PLAIN_BOUND or a few times one FA3 call's rounding on the same checkpoint), and greedy tokens follow
transformers' but where it rates two within twice that."""
import random

import pytest

from burstserve.engine import LLM, SamplingParams
from hf_reference import assert_same_greedy, fa3_fp8_attention_in, hf_next_logits_and_greedy, save_checkpoint
from burstserve.kernels.kv_quant import round_kv

EXACT = 5e-3          # an e4m3 rounding that fp32 noise tips the other way, one step on one element
PLAIN_BOUND = 0.25    # the rounding's own effect on these tiny models' logits (test_fp8_kv_cache's bound)
ONE_CALL_RATIO = 4    # the engine's FP8 error over one FA3 call's, same checkpoint: at most 3.53 in 1,280 cases


@pytest.fixture(scope="module", params=["llama3-gqa", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return path, save_checkpoint(request.param, path, seed=random.randrange(1 << 30))


def _plain(model, prompt):
    return hf_next_logits_and_greedy(model, prompt, 1)[0]


def _against_plain(llm, model, prompt, what) -> float:
    """The engine's logits against transformers unrounded: FP8 ran (more than 1e-3 apart) and moved them within
    PLAIN_BOUND, or within ONE_CALL_RATIO times what one FA3 call over the whole prompt moves them, where this
    random checkpoint's own FP8 error is that large (the engine rounds each chunk's and ring block's operands on
    their own scales, so its error is that call's, give or take: docs/results/log.md, 2026-12-04)."""
    plain = _plain(model, prompt)
    diff = (llm.next_token_logits(prompt) - plain).abs().max().item()
    with fa3_fp8_attention_in(model):
        one_call = (_plain(model, prompt) - plain).abs().max().item()
    assert 1e-3 < diff <= max(PLAIN_BOUND, ONE_CALL_RATIO * one_call), (what, len(prompt), diff, one_call)
    return diff


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_one_worker_in_chunks_attends_each_chunks_own_keys_in_fp8_and_the_cached_as_stored(checkpoint, kv):
    """A prompt of 300 in chunks of 64: each chunk's own K/V through FA3's arithmetic, its cached keys as the pages
    hold them (bf16 pages: exactly, merged by LSE; FP8 pages: their values gathered, in the same FA3 call as the
    chunk's own): equal to transformers with that attention (hf_reference.fa3_fp8_chunked) within EXACT. Fails
    if the chunks' own keys or the FP8 pages' keys skip FP8, or the model rounds K/V to the pages' grid before
    FP8 attention (each moves the logits by FP8's error)."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    prompt = [random.randrange(vocab) for _ in range(300)]
    with LLM(path, devices="cpu", dtype="float32", attention_backend="fa3-fp8", kv_cache_dtype=kv,
             max_num_batched_tokens=64, block_size=16) as llm:
        logits = llm.next_token_logits(prompt)
        stats = llm.generate(prompt + [1], SamplingParams(temperature=0, max_tokens=1))[0].metrics.prefill_stats
    bounds = [0, 64, 128, 192, 256, 300]
    with fa3_fp8_attention_in(model, bounds, round_kv if kv == "fp8" else None):
        want = _plain(model, prompt)
    assert (logits - want).abs().max().item() <= EXACT, kv
    assert stats.chunks is None or stats.largest_chunk <= 64, stats


def test_one_worker_rounds_as_fa3_does(checkpoint):
    path, model = checkpoint
    vocab = model.config.vocab_size
    with LLM(path, devices="cpu", dtype="float32", attention_backend="fa3-fp8",
             enable_chunked_prefill=False) as llm:
        assert llm.worker_facts[0].kernel == "fa3_fp8"
        for n in (37, 700):
            prompt = [random.randrange(vocab) for _ in range(n)]
            logits = llm.next_token_logits(prompt)
            with fa3_fp8_attention_in(model):
                want = _plain(model, prompt)
            assert (logits - want).abs().max().item() <= EXACT, n
            assert (logits - _plain(model, prompt)).abs().max().item() > 1e-3, n     # FP8 really ran


@pytest.mark.parametrize("workers,strategy,kv", [(2, "burst", "auto"), (2, "burst", "fp8"), (2, "ulysses", "auto"),
                                                 (1, "burst", "fp8")])
def test_rings_chunks_and_prefix_hits_attend_in_fp8(checkpoint, workers, strategy, kv):
    """A document in chunks of 64 (each chunk's own K/V through the FP8 kernel, its cached keys through the bf16
    one over bf16 pages, gathered through the FP8 one over FP8 pages), then a question after it (a prefix hit), then
    greedy tokens against transformers'."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    doc = [random.randrange(vocab) for _ in range(300)]
    question = doc + [random.randrange(vocab) for _ in range(45)]
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32", sp_strategy=strategy,
             block_size=16, kv_cache_dtype=kv, attention_backend="fa3-fp8", max_num_batched_tokens=64) as llm:
        what = f"{workers} workers, {strategy}, pages {kv}"
        _against_plain(llm, model, doc, what)
        error = _against_plain(llm, model, question, what)
        out = llm.generate(question, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert out.metrics.prefill_stats.cached_tokens >= 288, out.metrics.prefill_stats
        _, want = hf_next_logits_and_greedy(model, question, 8)
        # they may part only where transformers rates the two tokens within twice what FP8 moved the logits
        assert_same_greedy(model, question, out.outputs[0].token_ids, want, what, 2 * error)

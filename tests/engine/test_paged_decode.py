"""The paged KV cache and batched decode (issue 11), on CPU workers.

Small pages (4 tokens) so that page boundaries fall inside prompts and during decode; mixed prompt
lengths decoded in one batch must give exactly each sequence's solo tokens and logprobs, and
transformers' greedy tokens; a pool too small for every request at once preempts and recomputes,
with the same tokens; aborted requests give back every page."""
import random
import time

import pytest

from burstserve.engine import LLM, SamplingParams
from hf_reference import assert_same_logprobs, hf_greedy, save_checkpoint

GEN = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3-gqa"))
    return path, save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))


def _wait_stats(llm, key, want, seconds=10.0):
    """worker 0's published figures (sent when they change) reach `want` for `key`."""
    deadline = time.time() + seconds
    while getattr(llm.stats, key) != want and time.time() < deadline:
        time.sleep(0.05)
    return getattr(llm.stats, key)


def _mixed_requests(vocab: int, count: int):
    lengths = [random.randrange(1, 90) for _ in range(count)]
    prompts = [[random.randrange(vocab) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=2) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=random.randrange(1 << 20), max_tokens=GEN,
                             ignore_eos=True, logprobs=2)
              for i in range(count)]
    return prompts, params


def _assert_same(batched, solo, what):
    assert batched.token_ids == solo.token_ids, what
    for a, b in zip(batched.logprobs, solo.logprobs):
        assert_same_logprobs(a, b, 1e-4, what)


@pytest.mark.parametrize("workers", [2, 3])
def test_mixed_batch_gives_solo_tokens_and_logprobs_and_transformers_greedy(checkpoint, workers):
    path, model = checkpoint
    prompts, params = _mixed_requests(model.config.vocab_size, 12)
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=workers, dtype="float32", block_size=4) as llm:
        together = llm.generate(prompts, params)
        for prompt, p, out in zip(prompts, params, together):
            solo = llm.generate(prompt, p)[0]
            _assert_same(out.outputs[0], solo.outputs[0], f"{len(prompt)} tokens on {workers} workers")
            if p.greedy:
                assert out.outputs[0].token_ids == hf_greedy(model, prompt, GEN), f"{len(prompt)} tokens"
        pages = llm.worker_facts[0].kv_pages_per_worker
        assert _wait_stats(llm, "kv_pages_free", [pages] * workers) == [pages] * workers


@pytest.mark.parametrize("caching", [False, True])
def test_a_pool_too_small_for_all_preempts_and_every_request_completes_alike(checkpoint, caching):
    """8 requests of ~40-60 tokens each on 2 workers with 16 pages of 4 tokens per worker: each fits
    alone, all together need about 3x the pool, so decode preempts and recomputes (with the prefix
    cache: a preempted sequence's pages stay as an entry, given back from its tail as others need them,
    and it takes back what is left)."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    prompts = [[random.randrange(vocab) for _ in range(random.randrange(20, 40))] for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=1.0, seed=random.randrange(1 << 20), max_tokens=GEN, ignore_eos=True)
              for i in range(8)]
    with LLM(path, devices="cpu", enable_prefix_caching=caching, context_parallel_size=2, dtype="float32", block_size=4,
             kv_cache_tokens=64) as llm:
        assert llm.worker_facts[0].kv_pages_per_worker == 16
        together = llm.generate(prompts, params)
        preemptions = _wait_stats(llm, "running", 0) is not None and llm.stats.num_preemptions
        assert preemptions > 0, llm.stats
        if caching:                     # finished sequences stay as entries: nothing in use
            assert _wait_stats(llm, "kv_tokens_per_worker", [0, 0]) == [0, 0]
        else:
            assert _wait_stats(llm, "kv_pages_free", [16, 16]) == [16, 16]
        for prompt, p, out in zip(prompts, params, together):
            solo = llm.generate(prompt, p)[0].outputs[0]
            assert out.outputs[0].token_ids == solo.token_ids and out.outputs[0].finish_reason == "length"
            if p.greedy:
                assert solo.token_ids == hf_greedy(model, prompt, GEN)


def test_aborted_requests_return_every_page():
    with LLM("tiny", devices="cpu", enable_prefix_caching=False, context_parallel_size=2, block_size=8, kv_cache_tokens=4096) as llm:
        pages = llm.worker_facts[0].kv_pages_per_worker
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        ids = [llm.submit([random.randrange(256) for _ in range(random.randrange(1, 300))], params)
               for _ in range(6)]
        for rid in ids:                 # each has started decoding: pages taken on both workers
            next(llm.results(rid))
            next(llm.results(rid))
        assert _wait_stats(llm, "running", 6) == 6
        assert all(free < pages for free in llm.stats.kv_pages_free), llm.stats
        for rid in ids:
            llm.abort(rid)
        assert _wait_stats(llm, "kv_pages_free", [pages, pages]) == [pages, pages]
        assert llm.generate([5, 6, 7], SamplingParams(max_tokens=3))[0].outputs[0].finish_reason is not None


def test_a_request_larger_than_the_pool_is_refused_naming_both_numbers():
    from burstserve.engine import InvalidRequestError
    with LLM("tiny", devices="cpu", enable_prefix_caching=False, context_parallel_size=2, block_size=16, kv_cache_tokens=160) as llm:
        assert llm.kv_capacity_tokens == 320
        with pytest.raises(InvalidRequestError, match="prompt of 300 tokens plus max_tokens 50.*capacity of 320"):
            llm.generate([1] * 300, SamplingParams(max_tokens=50))
        out = llm.generate([1] * 250, SamplingParams(max_tokens=40, ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == 40


def test_choices_of_a_one_token_prompt_fork_on_workers_that_hold_none_of_it():
    """A 1-token prompt on 3 workers: two hold no prompt token; its n copies fork (nothing to copy there)
    and each decodes as it would alone. Found by the schema fuzz (worker 1 died on an empty page list)."""
    with LLM("tiny", devices="cpu", enable_prefix_caching=False, context_parallel_size=3, block_size=4) as llm:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=9, ignore_eos=True) for s in (1, 2, 3)]
        together = llm.generate([[7]] * 3, params)
        assert [bool(o.metrics.prefill_stats.shared_prefill) for o in together] == [False, True, True]
        for out, p in zip(together, params):
            assert out.outputs[0].token_ids == llm.generate([7], p)[0].outputs[0].token_ids

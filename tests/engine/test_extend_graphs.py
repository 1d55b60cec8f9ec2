"""The small extends' CUDA-graph forward (engine/runner/extend_graphs.py), run uncaptured on CPU workers
(BURSTSERVE_EXTEND_GRAPHS_ON_CPU=1): chunks padded up to the graph sizes, prefix runs without keys, the
chunk's K/V kept by one worker ("whole") or the only one ("local"), give transformers' logits (<= 1e-4,
fp32) and greedy tokens, and the same tokens as the eager extend; a cached prefix's question too; the
mixed batch by default only where graphed (the mixed batch through the graphs' forward:
tests/engine/test_chunked_prefill.py). The captured graphs against the eager extend on a GPU:
tests/gpu/test_gpu.py."""
import random

import pytest
import torch

from burstserve.engine import LLM, SamplingParams
from burstserve.engine.runner.extend_graphs import ON_CPU_ENV, SIZES, runs_for
from hf_reference import hf_next_logits_and_greedy, save_checkpoint

NUM_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3-gqa"))
    return path, save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))


def _generate(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("workers,chunk,ways", [(1, 64, {"local": 3}), (2, 50, {"whole": 3}),
                                                (3, 37, {"whole": 3}), (2, 130, {"whole": 3}), (3, 300, {"whole": 3})])
def test_graphed_chunks_match_transformers(checkpoint, monkeypatch, workers, chunk, ways):
    """Chunks of 37-300 tokens run in the graphs of 128 and 256 rows a worker (on several workers the rows
    split over them: 300 on 3 as 128 + 128 + 44, 130 on 2 as 128 + 2, 37 on 3 all on the first; padding
    rows after the chunk's); every graph cuts the cached keys into several runs, the first chunks' runs
    mostly without keys."""
    monkeypatch.setenv(ON_CPU_ENV, "1")
    path, model = checkpoint
    vocab = model.config.vocab_size
    prompts = [[random.randrange(vocab) for _ in range(n)] for n in (chunk + 1, 3 * chunk + 5, 3 * chunk + 300)]
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=workers, dtype="float32",
             max_num_batched_tokens=chunk, itl_target_ms=None) as llm:
        tokens = _generate(llm, prompts)
        for prompt, got in zip(prompts, tokens):
            ref_logits, ref_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
            diff = (llm.next_token_logits(prompt) - ref_logits).abs().max().item()
            assert diff <= 1e-4, (len(prompt), diff)
            assert got == ref_tokens, len(prompt)
        stats = llm.generate(prompts[1], SamplingParams(max_tokens=1))[0].metrics.prefill_stats
        assert stats.chunks == 4 and stats.extend_ways == ways and stats.graphed_extends == 3
    monkeypatch.delenv(ON_CPU_ENV)
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=workers, dtype="float32",
             max_num_batched_tokens=chunk, itl_target_ms=None) as llm:
        assert _generate(llm, prompts) == tokens                     # the eager extend gives the same
        assert llm.generate(prompts[1], SamplingParams(max_tokens=1))[0].metrics.prefill_stats.graphed_extends == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_a_question_after_a_cached_document_runs_graphed(checkpoint, monkeypatch, workers):
    """The prefix cache's extend (a 40-token question after a cached 300-token document) through the graphs'
    forward: transformers' logits and tokens."""
    monkeypatch.setenv(ON_CPU_ENV, "1")
    path, model = checkpoint
    vocab = model.config.vocab_size
    doc = [random.randrange(vocab) for _ in range(300)]
    questions = [doc + [random.randrange(vocab) for _ in range(40)] for _ in range(2)]
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32") as llm:
        _generate(llm, [doc])
        for prompt in questions:
            out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))[0]
            assert out.metrics.prefill_stats.cached_tokens > 0 and out.metrics.prefill_stats.graphed_extends == 1
            ref_logits, ref_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
            assert out.outputs[0].token_ids == ref_tokens
            assert (llm.next_token_logits(prompt) - ref_logits).abs().max().item() <= 1e-4


def test_runs_fill_the_sms_and_sizes_are_page_multiples():
    """llama3-8b's shapes on 132 SMs: 256 queries make 64 CTAs (2 runs), 512 and 1024 fill whole waves
    alone, 384 (96 CTAs) and 640 (160) run 4 runs to fill 3 and 5 waves (kernels/paged_attention.py)."""
    assert [runs_for(m, 4, 8, 132) for m in (128, 256, 384, 512, 640, 1024)] == [4, 2, 4, 1, 4, 1]
    assert all(m % 128 == 0 for m in SIZES) and SIZES[0] == 128


def test_mixed_batch_by_default_only_where_graphed(checkpoint, monkeypatch):
    """--mixed-batch unset: a chunk runs with the decode step in one pass only where the workers have that
    graph (chunks up to 1024 tokens a worker; plain graphs go to 2048): a 2400-token prompt in chunks of 1100
    while 3 requests decode runs its second chunk (1100, graphed) apart and its last (200) mixed; without the
    graphs (CPU) never mixed. Every request gets its solo tokens."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    short = [[random.randrange(vocab) for _ in range(n)] for n in (5, 20, 33)]
    long = [random.randrange(vocab) for _ in range(2400)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    common = dict(devices="cpu", enable_prefix_caching=False, dtype="float32", max_model_len=4096)
    with LLM(path, **common, enable_chunked_prefill=False) as llm:
        solo = [o.outputs[0].token_ids for o in llm.generate(short + [long], params)]
    for graphs in (True, False):
        if graphs:
            monkeypatch.setenv(ON_CPU_ENV, "1")
        else:
            monkeypatch.delenv(ON_CPU_ENV)
        with LLM(path, **common, max_num_batched_tokens=1100, itl_target_ms=None, max_num_seqs=8) as llm:
            outs = llm.generate(short + [long], params)
        assert [o.outputs[0].token_ids for o in outs] == solo
        stats = outs[-1].metrics.prefill_stats
        assert stats.chunks == 3 and stats.largest_chunk == 1100 and stats.smallest_chunk == 200
        assert stats.strategy == ("extend+decode" if graphs else "extend")     # the last chunk's call
        assert stats.graphed_extends == 2 * int(graphs) and stats.mixed_chunks == int(graphs)

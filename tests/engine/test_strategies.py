"""Every prefill strategy produces transformers' greedy tokens (and next-token logits) on CPU workers."""
import random

import pytest
import torch

from burstserve.engine import LLM, InvalidRequestError, SamplingParams
from burstserve.engine.model.config import EngineConfig, resolve_model
from burstserve.engine.parallel import SP_STRATEGIES, get_strategy
from burstserve.engine.parallel.zero import ZeroLayout
from hf_reference import assert_same_greedy, hf_next_logits_and_greedy, save_checkpoint


# Chunked prefill off: each prompt is prefilled whole by the strategy under test (with it on, a prompt that
# arrives while others decode may be chunked, its later chunks run as incremental prefills).
WHOLE = dict(enable_chunked_prefill=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("strategies"))
    return path, save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))


@pytest.mark.parametrize("strategy,workers", [
    ("burst-nolao", 2), ("burst-nolao", 4), ("ring-rsa", 2), ("ring-rsa", 4), ("ulysses", 2), ("ulysses", 4),
    ("tp", 2), ("tp", 4), ("tp-v3", 2), ("tp-v3", 4), ("cqs", 3), ("cqs", 4), ("cqs", 2), ("single", 3), ("burst", 2),
    ("burst-zero", 2), ("burst-zero", 4),       # 4: two workers' query heads read each K/V head
    ("burst-zero-sliced", 4),                   # the same, every prompt on the slices (engine/parallel/zero_sliced.py)
])
def test_strategy_matches_transformers(checkpoint, strategy, workers):
    path, model = checkpoint
    prompts = [[random.randrange(320) for _ in range(n)] for n in (1, 2 * workers - 1, 37, 300)]
    options = ({"sp_strategy": "burst-zero", "zero_sliced_max_tokens": 1000} if strategy == "burst-zero-sliced"
               else {"sp_strategy": strategy})
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32", **WHOLE, **options) as llm:
        assert llm.engine.world_size == (1 if strategy == "single" else workers)
        outs = llm.generate(prompts + prompts[-1:], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        assert outs[-1].metrics.prefill_stats.shared_prefill   # the repeated prompt forks the K/V
        if strategy == "burst-zero-sliced":
            assert {o.metrics.prefill_stats.strategy for o in outs[:-1]} == {"burst-zero-sliced"}
        for prompt, out in zip(prompts + prompts[-1:], outs):
            ref_logits, ref_tokens = hf_next_logits_and_greedy(model, prompt, 12)
            assert (llm.next_token_logits(prompt) - ref_logits).abs().max().item() <= 1e-4, (strategy, len(prompt))
            assert_same_greedy(model, prompt, out.outputs[0].token_ids, ref_tokens, (strategy, len(prompt)))


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("strategies-qwen3"))
    return path, save_checkpoint("qwen3", path, seed=random.randrange(1 << 30))


@pytest.mark.parametrize("strategy,workers", [
    *((name, 2) for name in ("burst", "burst-nolao", "ring-rsa", "ulysses", "cqs", "tp", "tp-v3", "auto",
                             "burst-zero")),
    ("burst", 3), ("ring-rsa", 3), ("cqs", 3),
])
def test_qwen3_under_every_strategy_matches_transformers(qwen3_checkpoint, strategy, workers):
    """Qwen3 dense (q and k normed per head before RoPE, a head_dim that is not hidden / heads): each
    strategy's logits and greedy tokens are transformers' (the one-worker and 4-worker cases:
    tests/engine/test_exactness.py)."""
    path, model = qwen3_checkpoint
    prompts = [[random.randrange(320) for _ in range(n)] for n in (1, 2 * workers - 1, 37, 300)]
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32", sp_strategy=strategy,
             **WHOLE) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            ref_logits, ref_tokens = hf_next_logits_and_greedy(model, prompt, 12)
            assert (llm.next_token_logits(prompt) - ref_logits).abs().max().item() <= 1e-4, (strategy, len(prompt))
            assert_same_greedy(model, prompt, out.outputs[0].token_ids, ref_tokens, (strategy, len(prompt)))


def _assert_burst_zero_matches(llm, model, prompts) -> None:
    """Each prompt prefilled by burst-zero gives transformers' next-token logits and 8 greedy tokens."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.metrics.prefill_stats.strategy == "burst-zero"
        ref_logits, ref_tokens = hf_next_logits_and_greedy(model, prompt, 8)
        assert (llm.next_token_logits(prompt) - ref_logits).abs().max().item() <= 1e-4, len(prompt)
        assert_same_greedy(model, prompt, out.outputs[0].token_ids, ref_tokens, len(prompt))


def test_no_overlap_gives_the_same_tokens(checkpoint):
    prompt = [random.randrange(320) for _ in range(200)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(checkpoint[0], devices="cpu", context_parallel_size=3, dtype="float32", overlap=False) as llm:
        slow = llm.generate(prompt, params)[0]
    _, ref = hf_next_logits_and_greedy(checkpoint[1], prompt, 8)
    assert slow.outputs[0].token_ids == ref
    assert slow.metrics.prefill_stats.exchange_seconds > 0


def test_unknown_strategy_and_indivisible_heads(checkpoint):
    with pytest.raises(InvalidRequestError, match="not one of"):
        LLM(checkpoint[0], devices="cpu", context_parallel_size=2, sp_strategy="magic")
    for strategy in ("ulysses", "tp"):           # burst-zero keeps the weights whole instead (the test below)
        with pytest.raises(InvalidRequestError, match="do not divide"):
            LLM(checkpoint[0], devices="cpu", context_parallel_size=3, sp_strategy=strategy)
    with pytest.raises(InvalidRequestError, match="burst-zero .* --mixed-batch") as e:
        LLM(checkpoint[0], devices="cpu", context_parallel_size=2, sp_strategy="burst-zero", mixed_batch=True)
    assert e.value.param == "mixed_batch"
    with pytest.raises(InvalidRequestError, match="fp8 is not supported") as e:
        LLM(checkpoint[0], devices="cpu", context_parallel_size=2, sp_strategy="burst-zero", quantization="fp8")
    assert e.value.param == "quantization"


def test_tp_slices_qkv_biases(tmp_path):
    model = save_checkpoint("qwen2", str(tmp_path), seed=random.randrange(1 << 30))
    prompt = [random.randrange(320) for _ in range(50)]
    ref_logits, ref_tokens = hf_next_logits_and_greedy(model, prompt, 8)
    with LLM(str(tmp_path), devices="cpu", context_parallel_size=2, dtype="float32", sp_strategy="tp") as llm:
        assert (llm.next_token_logits(prompt) - ref_logits).abs().max().item() <= 1e-4
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref_tokens


@pytest.mark.parametrize("name", SP_STRATEGIES)
def test_each_strategy_answers_its_weight_layout(name):
    """What ModelRunner asks of a worker's weights (engine/parallel/weight_layout.py), before any model is
    built: burst-zero over several workers cuts the vocabulary, keeps every head in the K/V cache and runs
    prompts on the slices up to the limit; every other strategy, and burst-zero on one worker, runs the
    weights local_config describes as they lie (its heads, no vocabulary split, nothing reserved or sliced)."""
    cfg, _ = resolve_model(EngineConfig(model="tiny", devices=["cpu"]))
    for world_size in (1, 2):
        strategy = get_strategy(name, world_size)
        rank = world_size - 1
        local, partial_sums = strategy.local_config(cfg, rank)
        layout = strategy.weight_layout(cfg, rank, torch.device("cpu"))
        sliced = isinstance(layout, ZeroLayout)
        assert sliced == (strategy.weight_slices(cfg, rank) != {} and not strategy.replicated_kv)
        assert (layout.local, layout.partial_sums) == (local, partial_sums)
        assert layout.whole_layers is None                   # the gatherer comes with the model (build_model)
        assert (layout.vocab is not None) == sliced
        assert layout.attn_cfg == (cfg if sliced else local)
        assert layout.sliced_limit(None, 100, None) == 0     # unset on CPU: no prompt on the slices
        assert layout.sliced_limit(500, 100, None) == (100 if sliced else 0)   # at most a worker's share
        assert layout.attention_sums == (not sliced)          # burst-zero: the attention's weights whole
        if not sliced:
            assert layout.reserve_bytes() == 0
            assert layout.extend_attention(print) == (print, None)


@pytest.mark.parametrize("workers", [3, 4, 5, 7, 8, 13])
def test_cqs_plan_computes_every_block_once(workers):
    from burstserve.engine.parallel.cqs import CQSPlan, difference_cover
    plan = CQSPlan(workers)
    blocks = [pair for tasks in plan.tasks for pair in tasks]
    assert sorted(blocks) == sorted((q, k) for q in range(workers) for k in range(q + 1))   # causal blocks, once
    assert all(set(plan.needs[w]) <= set(plan.quorums[w]) for w in range(workers))
    assert len(difference_cover(workers)) <= 1 + int(workers ** 0.5) + 1                   # near sqrt(W)
    sizes = [len(t) for t in plan.tasks]
    assert max(sizes) - min(sizes) <= 2, sizes


def test_auto_uses_ulysses_for_short_prompts_and_burst_for_long_ones(checkpoint):
    path, model = checkpoint
    prompts = [[random.randrange(320) for _ in range(n)] for n in (3, 40, 41, 300)]
    with LLM(path, devices="cpu", context_parallel_size=4, dtype="float32", **WHOLE, sp_strategy="auto",
             auto_ulysses_max_tokens=40) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            assert out.metrics.prefill_stats.strategy == ("ulysses" if len(prompt) <= 40 else "burst")
            ref_logits, ref_tokens = hf_next_logits_and_greedy(model, prompt, 10)
            assert (llm.next_token_logits(prompt) - ref_logits).abs().max().item() <= 1e-4, len(prompt)
            assert out.outputs[0].token_ids == ref_tokens, len(prompt)
    # 3 workers do not divide the heads
    with LLM(path, devices="cpu", context_parallel_size=3, dtype="float32", **WHOLE, sp_strategy="auto") as llm:
        out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
        assert out.metrics.prefill_stats.strategy == "burst"
    with pytest.raises(InvalidRequestError, match="auto_ulysses_max_tokens"):
        LLM(path, devices="cpu", context_parallel_size=2, sp_strategy="auto", auto_ulysses_max_tokens=-1)
    with pytest.raises(InvalidRequestError, match="zero_sliced_max_tokens must be >= 0, not -1"):
        LLM(path, devices="cpu", context_parallel_size=2, sp_strategy="burst-zero", zero_sliced_max_tokens=-1)


def test_burst_zero_keeps_whole_weights_where_its_workers_cannot_slice_them(checkpoint, capfd):
    """burst-zero on 3 workers of a model whose MLP width (160) they do not divide: no refusal; one warning at
    start (worker 0's log) names why, and every worker runs the whole weights as burst: transformers' logits
    and greedy tokens."""
    path, model = checkpoint
    prompts = [[random.randrange(320) for _ in range(n)] for n in (5, 200)]
    capfd.readouterr()
    with LLM(path, devices="cpu", context_parallel_size=3, dtype="float32", **WHOLE, sp_strategy="burst-zero") as llm:
        _assert_burst_zero_matches(llm, model, prompts)
    said = [line for line in capfd.readouterr().err.splitlines() if "--sp-strategy burst-zero:" in line]
    assert len(said) == 1, said
    assert said[0].endswith("--sp-strategy burst-zero: burst-zero splits the MLP width 160; 3 workers do not divide "
                            "it, so every worker holds the whole weights (as burst)"), said


def test_auto_says_at_start_when_the_heads_do_not_divide(tmp_path, capfd):
    """auto on workers that do not divide the query heads (3 of the checkpoint's 4) never runs ulysses: one
    warning at start (in worker 0's log) says so, and a short prompt runs burst; where they divide, no such
    line and ulysses."""
    save_checkpoint("llama3-gqa", str(tmp_path), seed=random.randrange(1 << 30))
    for workers, way in ((3, "burst"), (2, "ulysses")):
        capfd.readouterr()
        with LLM(str(tmp_path), devices="cpu", context_parallel_size=workers, sp_strategy="auto", **WHOLE) as llm:
            out = llm.generate([[1, 2, 3] * 20], SamplingParams(max_tokens=2))[0]
        assert out.metrics.prefill_stats.strategy == way
        said = [line for line in capfd.readouterr().err.splitlines() if "do not divide" in line]
        if workers == 3:
            assert len(said) == 1 and said[0].endswith("--sp-strategy auto: the 4 query heads do not divide over 3 "
                                                       "workers, which ulysses needs, so every prompt runs burst"), said
        else:
            assert said == [], said

"""Asynchronous scheduling (engine/scheduler/decode_steps.py DecodeSteps.ahead, engine/runner/step_tokens.py): worker 0 launches
decode step k+1 before reading step k's tokens, whose values reach step k+1 on the device. A request
must get exactly the tokens it gets with every step read back first (async_scheduling=False), and a
sequence ended by a stop token while the next step was in flight keeps that step's K/V of the stop
token in its prefix-cache entry: a follow-up prompt reusing it must give its cold answer. (Greedy
tokens may part only at a near-tie, hf_reference.assert_same_greedy: a step with one row more, a
stopped sequence's, may round a row's fp32 logits differently.)"""
import random
import time

import pytest

from burstserve.engine import LLM, SamplingParams
from burstserve.engine.cache.prefix_cache import BLOCK
from burstserve.engine.core.calls import Decode, Prefill
from burstserve.engine.model.config import EngineConfig
from hf_reference import assert_same_greedy, hf_greedy, save_checkpoint
from scheduler_harness import serve_in_process

GEN = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3-gqa"))
    return path, save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))


def _serve(path: str, batches: list[list[tuple]], **kw):
    """Worker 0's scheduler in-process over one CPU ModelRunner (the checkpoint, fp32, pages of 4 tokens;
    tests/scheduler_harness.py): batches of (request id, prompt, SamplingParams) -> (outputs by request id,
    the scheduler's calls (engine/core/calls.py), the scheduler)."""
    engine = EngineConfig(model=path, devices=["cpu"], dtype="float32", block_size=4, max_num_seqs=8, **kw)
    return serve_in_process(engine, batches)


def _tokens(got: dict) -> dict:
    return {rid: [o.token_id for o in outs] for rid, outs in got.items()}


def _ahead(calls) -> int:
    """Decode calls whose input tokens came from the step before, on the device."""
    return sum(1 for c in calls if isinstance(c, Decode) and c.fed_from is not None)


def _stopping(prompts: list[list[int]], greedy: dict) -> list[tuple]:
    """Requests that end at a stop token: one of the tokens their greedy run gives (its first occurrence
    ends it), or at max_tokens; some with a few max_tokens only."""
    batch = []
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        stop = [greedy[rid][random.randrange(2, GEN - 2)]] if i % 3 != 2 else []
        batch.append((rid, prompt, SamplingParams(temperature=0, max_tokens=GEN if i % 4 else 5,
                                                  stop_token_ids=stop, ignore_eos=True)))
    return batch


def _greedy(path: str, prompts: list[list[int]]) -> dict:
    plain = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)) for i, p in enumerate(prompts)]
    return _tokens(_serve(path, [plain], async_scheduling=False)[0])


def _assert_alike(model, batch: list[tuple], got: dict, want: dict) -> None:
    """Each request's tokens (and, where they are the same, finish reason) as in `want`."""
    for rid, prompt, _ in batch:
        a, b = _tokens(got)[rid], _tokens(want)[rid]
        if a == b:
            assert got[rid][-1].finish_reason == want[rid][-1].finish_reason, rid
        else:
            n = min(len(a), len(b))
            assert_same_greedy(model, prompt, a[:n], b[:n], rid)
            assert a[:n] != b[:n], (rid, "ended at another place with the same tokens", a, b)


def test_steps_run_ahead_and_give_the_tokens_of_steps_read_back_first(checkpoint):
    """Eight prompts of 5-40 tokens, greedy, ending at stop tokens or max_tokens: with asynchronous
    scheduling most steps are launched ahead and every request gets the tokens (and finish reason) it
    gets with async_scheduling=False."""
    path, model = checkpoint
    prompts = [[random.randrange(256) for _ in range(random.randrange(5, 41))] for _ in range(8)]
    batch = _stopping(prompts, _greedy(path, prompts))
    want, calls, _ = _serve(path, [batch], async_scheduling=False)
    assert _ahead(calls) == 0
    got, calls, _ = _serve(path, [batch])
    _assert_alike(model, batch, got, want)
    assert {o.finish_reason for outs in got.values() for o in outs[-1:]} == {"stop", "length"}
    steps = sum(1 for c in calls if isinstance(c, Decode))
    assert _ahead(calls) >= steps // 2, (_ahead(calls), steps)


def test_a_stop_tokens_kv_computed_ahead_is_cached_and_reused_as_its_cold_answer(checkpoint):
    """A request ended by a stop token while the next step ran ahead keeps that step's K/V of the stop
    token: its prefix-cache entry holds prompt + every generated token. A follow-up prompt (prompt +
    answer + a new turn) reuses all of it and answers as a cold engine (no prefix cache) does. Prompts of a
    prefix-cache block or more: a stop token may end an answer after 1 token, and a hit takes a whole block."""
    path, model = checkpoint
    prompts = [[random.randrange(256) for _ in range(random.randrange(BLOCK, 30))] for _ in range(4)]
    greedy = _greedy(path, prompts)
    first = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True,
                                         stop_token_ids=[greedy[f"r{i}"][random.randrange(6, GEN - 4)]]))
             for i, p in enumerate(prompts)]
    got, calls, scheduler = _serve(path, [first])
    answers = _tokens(got)
    turns = [(f"{rid}-next", p + answers[rid] + [random.randrange(256) for _ in range(5)],
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for rid, p, _ in first]
    got, calls, scheduler = _serve(path, [first, turns])
    assert {rid: _tokens(got)[rid] for rid, _, _ in first} == answers
    assert all(got[rid][-1].finish_reason == "stop" for rid, _, _ in first)
    ended_ahead = [rid for rid, p, _ in first
                   if len(scheduler.kv.prefix_cache.entries.get(_seq_of(calls, p), [])) == len(p) + len(answers[rid])]
    assert ended_ahead, "no request ended while the next step was in flight"
    cold, _, _ = _serve(path, [turns], enable_prefix_caching=False)
    _assert_alike(model, turns, got, cold)
    for rid, p, _ in first:
        if rid in ended_ahead:           # all of prompt + answer, the stop token's K/V included
            assert got[f"{rid}-next"][0].prefill.cached_tokens == len(p) + len(answers[rid]), rid


def _seq_of(calls, prompt: list[int]) -> int:
    """The sequence id the scheduler gave the prompt (its prefill call's first argument)."""
    return next(c.seq_id for c in calls if isinstance(c, Prefill) and c.token_ids.tolist() == prompt)


def test_logprobs_come_with_the_tokens_of_steps_run_ahead(checkpoint):
    """Rows asking logprobs (greedy and seeded sampling) run ahead too, their entries copied to the host
    with the tokens: the same entries as with every step read back first (the same batches: exact)."""
    path, _ = checkpoint
    prompts = [[random.randrange(256) for _ in range(random.randrange(5, 30))] for _ in range(4)]
    batch = [(f"r{i}", p, SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=10, ignore_eos=True,
                                         logprobs=[None, 0, 3, 5][i])) for i, p in enumerate(prompts)]
    want, calls, _ = _serve(path, [batch], async_scheduling=False)
    assert _ahead(calls) == 0
    got, calls, _ = _serve(path, [batch])
    assert _ahead(calls) >= 4
    assert _tokens(got) == _tokens(want)
    for rid in got:
        assert [o.logprobs for o in got[rid]] == [o.logprobs for o in want[rid]], rid
    assert all(o.logprobs is None for o in got["r0"]) and all(len(o.logprobs) == 1 for o in got["r1"])
    assert all(5 <= len(o.logprobs) <= 6 for o in got["r3"])             # its top 5 and the chosen token


@pytest.mark.parametrize("workers", [1, 2])
def test_sampled_and_greedy_requests_on_workers_get_the_tokens_of_sync_scheduling(checkpoint, workers):
    """Twelve requests (greedy, and seeded temperature / top-k / top-p sampling; stop tokens, max_tokens)
    decoded together on 1 and 2 CPU workers (the step's tokens broadcast from worker 0 to the other on
    the device): the same tokens and finish reasons with and without asynchronous scheduling, greedy
    ones transformers' own, and after them every page free again."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    prompts = [[random.randrange(vocab) for _ in range(random.randrange(3, 60))] for _ in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.9, top_k=[-1, 20][i % 4 // 2], top_p=[1.0, 0.8][i % 3 == 0],
                             seed=random.randrange(1 << 20), max_tokens=GEN - i, ignore_eos=True)
              for i in range(12)]
    common = dict(devices="cpu", context_parallel_size=workers, dtype="float32", block_size=4,
                  enable_prefix_caching=False, enable_chunked_prefill=False)   # chunk sizes follow timings
    with LLM(path, async_scheduling=False, **common) as llm:
        want = llm.generate(prompts, params)
    for i, (p, out) in enumerate(zip(params, want)):      # stops at one of its tokens for half of them
        if i % 4 < 2:
            p.stop_token_ids = [out.outputs[0].token_ids[random.randrange(1, len(out.outputs[0].token_ids))]]
    with LLM(path, async_scheduling=False, **common) as llm:
        want = llm.generate(prompts, params)
    with LLM(path, **common) as llm:
        got = llm.generate(prompts, params)
        pages = llm.worker_facts[0].kv_pages_per_worker
        deadline = time.time() + 10
        while llm.stats.kv_pages_free != [pages] * workers and time.time() < deadline:
            time.sleep(0.05)
        assert llm.stats.kv_pages_free == [pages] * workers
    for prompt, p, a, b in zip(prompts, params, got, want):
        a, b = a.outputs[0], b.outputs[0]
        if a.token_ids == b.token_ids:
            assert a.finish_reason == b.finish_reason, (len(prompt), p)
        elif p.greedy:
            n = min(len(a.token_ids), len(b.token_ids))
            assert_same_greedy(model, prompt, a.token_ids[:n], b.token_ids[:n], len(prompt))
        else:
            raise AssertionError((len(prompt), p, a.token_ids, b.token_ids))
        if p.greedy:
            assert_same_greedy(model, prompt, a.token_ids, hf_greedy(model, prompt, len(a.token_ids)), len(prompt))


def test_a_short_prompt_beside_a_chunked_one_makes_a_batch_of_max_num_seqs_plus_one():
    """A short request prefilled beside a prompt prefilled in chunks (Scheduler._short_head_goes_first)
    may join a full batch: max_num_seqs + 1 rows, whose tokens must all be kept on the device. Found by
    review: with max_num_seqs rows kept, worker 0 died on that step."""
    prompts = [[random.randrange(256) for _ in range(64)], [random.randrange(256) for _ in range(4)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for asynchronous in (False, True):
        with LLM("tiny", devices="cpu", dtype="float32", block_size=4, max_num_seqs=1, max_num_batched_tokens=16,
                 enable_prefix_caching=False, async_scheduling=asynchronous) as llm:
            runs[asynchronous] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert runs[True] == runs[False] and all(len(t) == 8 for t in runs[True])

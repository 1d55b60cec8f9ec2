"""The scheduler's plan (engine/scheduler/policy.py) is a question, not an action: every plan computed over a run
that admits, chunks, preempts, resumes, evicts prefix-cache entries, restores from the KV host tier and
decodes ahead leaves the KV manager, the worker's pages, the prefix cache, the host tier and the scheduler's
state exactly as they were, and calls no worker. The run's tokens are those of a pool large enough for every
request (the plans carried out do what the scheduler did before plans existed: tests/engine/test_recompute.py
and test_async_scheduling.py). A plan is complete: carrying it out asks the policy nothing more. Carrying it
out sends the other workers at most one message (engine/scheduler/dispatch.py), and those messages hold worker 0's
calls, all of them, in worker 0's order."""
import copy
import inspect
import random

import pytest

from burstserve.engine.core.calls import Decode, DecodeAhead, Extend, ExtendAndDecode, Offload, Prefill, Shutdown
from burstserve.engine.core.sampling import SamplingParams
from burstserve.engine.model.config import EngineConfig
from burstserve.engine.scheduler import policy as plans
from scheduler_harness import serve_in_process


def _snapshot(scheduler, runner) -> tuple:
    """Everything a plan could change: the ledger, the page pool's bookkeeping, the prefix cache, the queues."""
    kv, s, pool = scheduler.kv, scheduler.state, runner.pool
    cache = kv.prefix_cache
    ledger = (copy.deepcopy(kv.ledger.seqs), list(kv.ledger.pages_used))
    pages = (copy.deepcopy(pool.pages), dict(pool.lengths), dict(pool.rows), bytes(pool.held._in_use),
             list(pool._free_rows), pool.table.clone().tolist())
    prefix = (copy.deepcopy(cache.entries), list(cache.entries), copy.deepcopy(cache.index), dict(cache.used),
              cache.tick, cache.queries, cache.hits)
    queues = ([r.request_id for r in s.waiting], [x.seq_id for x in s.preempted], [x.seq_id for x in s.running],
              None if s.prefilling is None else (s.prefilling.seq.seq_id, s.prefilling.done), s.inflight,
              set(s.aborted), s.decode_owed, s.short_went_first, s.step_seconds,
              [(x.seq_id, list(x.generated), x.preemptions) for x in [*s.running, *s.preempted]])
    sizer = None if scheduler.sizer is None else list(scheduler.sizer.calls)
    host = None
    if kv.host is not None:     # the KV host tier: its ledger, its pages, its index
        h = kv.host_cache
        host = (copy.deepcopy(kv.host.seqs), list(kv.host.pages_used), copy.deepcopy(runner.cache.host.pages),
                bytes(runner.cache.host.held._in_use), copy.deepcopy(h.entries), list(h.entries), dict(h.used),
                kv.host_hits)
    return ledger, pages, prefix, queues, sizer, host


def _workload() -> tuple[list, dict]:
    """Requests that admit, chunk, preempt, resume, evict, restore and decode ahead -> (the batch, the engine's
    options but its pool)."""
    rng = random.Random()
    vocab = 256
    # lengths fixed, tokens drawn: in a pool of 40 pages of 4 tokens, two 58-60-token prompts growing by 30
    # tokens each cannot both run (two preemptions), and the questions' cached document is evicted from its tail.
    # (Lengths drawn from 56-60 and 4-19 preempted in every one of 500 draws here, yet a fresh-clone run once
    # found none: the layout is fixed, the scheduler's choices following from the lengths alone.)
    question_lengths, prompt_lengths = (19, 15, 11, 7), (60, 59, 58, 60)
    answer_lengths, output_lengths = (12, 10, 11, 12), (30, 30, 29, 30)
    doc = [rng.randrange(vocab) for _ in range(48)]
    prompts = {f"q{i}": doc + [rng.randrange(vocab) for _ in range(n)] for i, n in enumerate(question_lengths)}
    prompts.update({f"p{i}": [rng.randrange(vocab) for _ in range(n)] for i, n in enumerate(prompt_lengths)})
    max_tokens = {**{f"q{i}": n for i, n in enumerate(answer_lengths)},
                  **{f"p{i}": n for i, n in enumerate(output_lengths)}}
    params = {rid: SamplingParams(temperature=0, max_tokens=max_tokens[rid], ignore_eos=True) for rid in prompts}
    batch = [(rid, prompt, params[rid]) for rid, prompt in prompts.items()]
    engine = dict(model="tiny", devices=["cpu"], dtype="float32", block_size=4, max_num_seqs=8,
                  max_num_batched_tokens=16, itl_target_ms=None, enable_prefix_caching=True)
    return batch, engine


SMALL_POOL = dict(kv_cache_tokens=160, kv_offload_gb=0.01)


def test_every_plan_changes_nothing():
    batch, engine = _workload()
    seen, calls_during_plans = [], []

    def check_plans(scheduler, runner):
        plan, calls = scheduler.policy.plan, [0]

        def counted(call):
            def counting(message):
                calls[0] += 1
                return call(message)
            return counting

        scheduler.call.run_here = counted(scheduler.call.run_here)       # every call, the KV manager's too

        def checked(state):
            before, calls_before = _snapshot(scheduler, runner), calls[0]
            result = plan(state)
            assert _snapshot(scheduler, runner) == before, type(result).__name__
            calls_during_plans.append(calls[0] - calls_before)
            seen.append(result)
            return result

        scheduler.policy.plan = checked

    want, _, _ = serve_in_process(EngineConfig(**engine, kv_cache_tokens=4096), [batch])
    got, calls, scheduler = serve_in_process(EngineConfig(**engine, **SMALL_POOL), [batch], check_plans)
    assert {r: [o.token_id for o in outs] for r, outs in got.items()} == \
        {r: [o.token_id for o in outs] for r, outs in want.items()}
    assert not any(calls_during_plans)
    kinds = {type(p) for p in seen}
    assert {plans.Admit, plans.PrefillChunk, plans.DecodeStep, plans.StepAhead, plans.ReadBack, plans.Preempt,
            plans.Resume} <= kinds, kinds
    assert any(getattr(p, "evict", None) for p in seen), "no plan evicted a prefix-cache entry"
    assert scheduler.preemptions.count > 0, "the pool was large enough for every request at once"
    assert any(isinstance(c, Offload) for c in calls), "nothing was written to the host tier"


def test_a_turn_sends_the_other_workers_one_message_with_worker_0s_calls_in_order():
    batch, engine = _workload()
    sent, sent_by_turn, last = [], [], [0]

    def count_turns(scheduler, runner):
        update = scheduler.update

        def counted(result):            # a turn ends with its update (its changes go with the next turn's work)
            update(result)
            sent_by_turn.append(len(sent) - last[0])
            last[0] = len(sent)

        scheduler.update = counted

    got, calls, scheduler = serve_in_process(EngineConfig(**engine, **SMALL_POOL), [batch], count_turns, sent=sent)
    assert len(got) == len(batch)
    assert max(sent_by_turn) == 1 and len(sent_by_turn) > 50, sent_by_turn
    assert isinstance(sent[-1].work, Shutdown) and not sent[-1].changes   # sent before the scheduler waited
    relayed = [call for turn in sent for call in [*turn.changes, turn.work] if call is not None]
    assert relayed[:-1] == calls                   # the same objects, in the same order
    assert len(calls) > sum(sent_by_turn), "no turn carried the cache's changes with its work"
    assert scheduler.preemptions.count > 0 and any(isinstance(c, Offload) for c in calls)


def test_schedule_takes_the_works_pages_in_the_ledger_before_any_worker_runs_it():
    """schedule() returns the turn's StepPlan with its work placed: the ledger holds the work's new tokens and
    their pages while the worker's pool does not yet, and execute runs exactly that call (the same object)."""
    batch, engine = _workload()
    checked, wrong = [0], []

    def watch(scheduler, runner):
        execute, kv, pool = scheduler.execute, scheduler.kv, runner.pool

        def checked_execute(plan):
            work = plan.work
            if isinstance(work, (Prefill, Extend, ExtendAndDecode, Decode)):
                checked[0] += 1
                ids = _work_seq_ids(work)
                ahead = {s: kv.ledger.seqs[s].tokens[0] - pool.lengths.get(s, 0) for s in ids}
                if not _placed(work) or not all(n > 0 for n in ahead.values()):
                    wrong.append((type(work).__name__, ahead))
            result = execute(plan)
            if isinstance(work, (Prefill, Extend, ExtendAndDecode, Decode)):
                after = {s: kv.ledger.seqs[s].tokens[0] - pool.lengths[s] for s in _work_seq_ids(work)
                         if s in pool.lengths}
                if any(after.values()):
                    wrong.append(("after", type(work).__name__, after))
            return result

        scheduler.execute = checked_execute

    got, calls, scheduler = serve_in_process(EngineConfig(**engine, **SMALL_POOL, mixed_batch=True), [batch], watch)
    assert len(got) == len(batch) and checked[0] > 50, checked
    assert not wrong, wrong[:3]


def _work_seq_ids(work) -> list[int]:
    if isinstance(work, ExtendAndDecode):
        return [work.extend.seq_id, *work.decode.seq_ids]
    return list(work.seq_ids) if isinstance(work, Decode) else [work.seq_id]


def _placed(work) -> bool:
    """Does the call carry the KV manager's placement (its pages)?"""
    if isinstance(work, ExtendAndDecode):
        return _placed(work.extend) and _placed(work.decode)
    if isinstance(work, Decode):
        return work.owners is not None and work.new_pages is not None
    return (work.pages if isinstance(work, Prefill) else work.placed) is not None


@pytest.mark.parametrize("asynchronous", [True, False])
def test_update_is_the_only_place_a_turns_results_change_the_schedulers_state(asynchronous):
    """Every token committed (a sequence running on or ended, a request's first token with its figures) happens
    inside Scheduler.update, over a run whose StepResults hold prompts and chunks, chunks mixed with a decode
    step, and decode steps read back at once or (asynchronous scheduling) launched ahead; the run's tokens are
    all there."""
    batch, engine = _workload()
    outside, kinds, updating = [], set(), [0]

    def watch_update(scheduler, runner):
        update, commit = scheduler.update, scheduler._commit

        def watched_update(result):
            kinds.update(name for name in ("prompt", "decode", "launch", "read_back")
                         if getattr(result.plan, name) is not None)
            updating[0] += 1
            try:
                update(result)
            finally:
                updating[0] -= 1

        def watched_commit(seq, *args, **kwargs):
            if not updating[0]:
                outside.append(seq.request.request_id)
            return commit(seq, *args, **kwargs)

        scheduler.update, scheduler._commit = watched_update, watched_commit

    options = dict(engine, **SMALL_POOL, mixed_batch=True, async_scheduling=asynchronous)
    got, calls, scheduler = serve_in_process(EngineConfig(**options), [batch], watch_update)
    assert {rid: len(outs) for rid, outs in got.items()} == {rid: p.max_tokens for rid, _, p in batch}
    assert not outside, outside
    assert kinds == ({"prompt", "decode", "launch", "read_back"} if asynchronous else {"prompt", "decode"}), kinds
    assert any(isinstance(c, DecodeAhead) == asynchronous for c in calls if isinstance(c, Decode))
    assert any(isinstance(c, ExtendAndDecode) for c in calls), "no chunk was mixed with a decode step"


def test_carrying_a_plan_out_asks_the_policy_nothing():
    """Making the policy's move into a StepPlan (plan_of), executing it and updating from its result ask the
    policy nothing: its move is complete."""
    batch, engine = _workload()
    asked, seen = [], []

    def watch_policy(scheduler, runner):
        policy, carrying = scheduler.policy, [False]
        for name, method in inspect.getmembers(policy, inspect.ismethod):
            def watched(*args, name=name, method=method, **kwargs):
                if carrying[0]:
                    asked.append(name)
                return method(*args, **kwargs)
            setattr(policy, name, watched)

        def carrying_out(step, record=False):
            def watched(arg):
                if record:
                    seen.append(type(arg))
                carrying[0] = True
                try:
                    return step(arg)
                finally:
                    carrying[0] = False
            return watched

        scheduler.plan_of = carrying_out(scheduler.plan_of, record=True)
        scheduler.execute, scheduler.update = carrying_out(scheduler.execute), carrying_out(scheduler.update)

    got, calls, scheduler = serve_in_process(EngineConfig(**engine, **SMALL_POOL), [batch], watch_policy)
    assert len(got) == len(batch)
    # which plans a draw makes varies (a preemption may be a give-way, never resumed): the kinds every draw makes
    assert {plans.Admit, plans.PrefillChunk, plans.DecodeStep} <= set(seen), set(seen)
    assert not asked, sorted(set(asked))


def test_the_kv_managers_ledger_is_what_the_worker_holds_after_every_turn():
    """The KV manager keeps the one ledger and places every call (engine/cache/kv_manager.py); the worker stores
    what it is told. After every turn of a run that admits, chunks, preempts, resumes, evicts, writes to the
    host tier and restores from it, and decodes ahead, the ledger's tokens and page ids on this worker are the
    pool's, sequence by sequence, and the host tier's ledger's page ids are the host pool's entries'."""
    batch, engine = _workload()
    mismatches, turns, kinds = [], [0], set()

    def compare_after_each_turn(scheduler, runner):
        kv, pool, plan_of, update = scheduler.kv, runner.pool, scheduler.plan_of, scheduler.update
        move = [None]

        def recorded(m):
            move[0] = m
            kinds.add(type(m))
            return plan_of(m)

        def compared(result):
            update(result)
            turns[0] += 1
            name = type(move[0]).__name__
            held = {s: seq.tokens[0] for s, seq in kv.ledger.seqs.items()}
            on_pages = {s: seq.pages[0] for s, seq in kv.ledger.seqs.items()}
            if held != pool.lengths or on_pages != pool.pages or kv.ledger.free_pages()[0] != pool.free_pages:
                mismatches.append((name, held, dict(pool.lengths)))
            host = runner.cache.host
            if {h: seq.pages[0] for h, seq in kv.host.seqs.items()} != host.pages:
                mismatches.append((name, "host tier", list(kv.host.seqs), dict(host.pages)))

        scheduler.plan_of, scheduler.update = recorded, compared

    got, calls, scheduler = serve_in_process(EngineConfig(**engine, **SMALL_POOL), [batch], compare_after_each_turn)
    assert len(got) == len(batch) and turns[0] > 50, turns
    assert {plans.Admit, plans.PrefillChunk, plans.DecodeStep, plans.StepAhead} <= kinds, kinds
    assert scheduler.preemptions.count > 0 and any(isinstance(c, Offload) for c in calls)
    assert not mismatches, mismatches[:3]


def test_a_prompts_next_token_is_drawn_on_the_device_and_its_logits_stay_there():
    """One sampling path: every prompt call's next token is drawn by the worker, as a decode step's rows are
    (SampleNext), with its logprobs where asked; no token is drawn on the host but a twin's first (no grammar
    here), from its twin's logits, which a request's first token brings back; a chunk before the last returns
    nothing."""
    batch, engine = _workload()
    rng = random.Random()
    drawn = [SamplingParams(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 30), max_tokens=5, logprobs=2),
             SamplingParams(temperature=0.7, top_k=5, max_tokens=5, ignore_eos=True)]
    twin = [rng.randrange(256) for _ in range(9)]
    batch += [("s0", [rng.randrange(256) for _ in range(7)], drawn[0]), ("s1", twin, drawn[1]),
              ("s2", list(twin), drawn[1])]
    prompt_calls, on_host = [], []

    def watch(scheduler, runner):
        run_here, sample = scheduler.call.run_here, scheduler.tokens.sample

        def recorded(message):
            result = run_here(message)
            work = message.extend if isinstance(message, ExtendAndDecode) else message
            if isinstance(work, (Prefill, Extend)):
                prompt_calls.append((work, result))
            return result

        def host_sample(seq, logits, sample_logits=None):
            on_host.append(seq.request.request_id)
            return sample(seq, logits, sample_logits)

        scheduler.call.run_here, scheduler.tokens.sample = recorded, host_sample

    got, calls, scheduler = serve_in_process(EngineConfig(**engine, kv_cache_tokens=4096), [batch], watch)
    assert len(got) == len(batch)
    sampled = [(w, r) for w, r in prompt_calls if w.sample_next is not None]
    assert all(r.token is not None for w, r in sampled)
    assert all((r.logits is not None) == w.sample_next.logits for w, r in sampled)
    assert all(r.token is None and r.logits is None for w, r in prompt_calls if w.sample_next is None)
    assert any(w.sample_next is None for w, r in prompt_calls), "no prompt ran in chunks"
    assert got["s2"][0].prefill.shared_prefill                               # s2 copied its running twin s1
    assert on_host == ["s2"], on_host                                        # only the twin's copy drew on the host
    assert got["s0"][0].logprobs is not None and len(got["s0"][0].logprobs) >= 2

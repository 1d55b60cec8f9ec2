"""A preempted sequence is recomputed as a prompt is prefilled (engine/scheduler/scheduler.py): in chunks of
--max-num-batched-tokens when it is longer than one, so the other sequences' decode steps run between
the chunks instead of waiting for one long prefill, and from the longest prefix the prefix cache holds.
Worker 0's Scheduler runs here in-process over one CPU ModelRunner (tiny preset, fp32) so that every
call it makes is seen; each request's tokens equal those of a pool large enough for all of them."""
import random

import pytest

from burstserve.engine.core.calls import Adopt, Extend, Free, Prefill, Reinstate, Truncate
from burstserve.engine.core.sampling import SamplingParams
from burstserve.engine.model.config import EngineConfig
from scheduler_harness import serve_in_process

CHUNK = 16
GEN = 24


def _serve(engine: EngineConfig, batches: list[list[tuple]], prepare=None):
    """Runs worker 0's scheduler over one ModelRunner (tests/scheduler_harness.py); each batch of
    (request id, prompt[, max_tokens]) is submitted when the one before has finished (greedy, GEN tokens
    unless given) -> (tokens by request id, the scheduler's calls (engine/core/calls.py), the ids of the
    sequences it preempted, the scheduler). prepare(scheduler, runner): more spies, installed after this one's."""
    preempted = []

    def spy(scheduler, runner):
        preempt = scheduler.preemptions.preempt
        scheduler.preemptions.preempt = lambda seq, *rest: (preempted.append(seq.seq_id), preempt(seq, *rest))
        if prepare is not None:
            prepare(scheduler, runner)

    batches = [[(rid, prompt, SamplingParams(temperature=0, max_tokens=(max_tokens or [GEN])[0], ignore_eos=True,
                                             logprobs=2))
                for rid, prompt, *max_tokens in batch] for batch in batches]
    got, calls, scheduler = serve_in_process(engine, batches, spy)
    tokens = {rid: [o.token_id for o in outs] for rid, outs in got.items()}
    _LOGPROBS.update({rid: [o.logprobs for o in outs] for rid, outs in got.items()})
    return tokens, calls, preempted, scheduler


_LOGPROBS: dict[str, list] = {}     # the last _serve's top-2 logprobs per token, by request id


def _assert_same_tokens(got: dict, want: dict, want_logprobs: dict) -> None:
    """got == want per request, or they part where the reference's top two logprobs are within fp32 noise
    of each other (a near-tie that another summation order may break the other way)."""
    assert got.keys() == want.keys()
    for rid in want:
        for i, (a, b) in enumerate(zip(got[rid], want[rid])):
            if a != b:
                top = sorted(want_logprobs[rid][i].values(), reverse=True)
                assert top[0] - top[1] < 1e-4, (rid, i, a, b, top)
                break


def _engine(**kw) -> EngineConfig:
    return EngineConfig(model="tiny", devices=["cpu"], dtype="float32", block_size=4, max_num_seqs=8,
                        max_num_batched_tokens=CHUNK, itl_target_ms=None, **kw)


def _prompts(count: int, low: int, high: int, prefix: list[int] = ()) -> list[tuple[str, list[int]]]:
    return [(f"r{i}", list(prefix) + [random.randrange(256) for _ in range(random.randrange(low, high))])
            for i in range(count)]


def test_a_preempted_sequence_is_recomputed_in_chunks_with_the_same_tokens():
    """Six prompts of 20-30 tokens that each grow by 24 in a pool of 40 pages of 4 tokens: decode
    preempts; every recompute (prompt + generated, 21-53 tokens) runs in calls of at most 16 tokens."""
    batch = _prompts(6, 20, 31)
    want, _, preempted, _ = _serve(_engine(kv_cache_tokens=4096, enable_prefix_caching=False), [batch])
    want_logprobs = dict(_LOGPROBS)
    assert not preempted
    got, calls, preempted, scheduler = _serve(_engine(kv_cache_tokens=160, enable_prefix_caching=False), [batch])
    recomputed = scheduler.preemptions.recomputed_tokens
    assert preempted and recomputed > CHUNK, (preempted, recomputed)
    _assert_same_tokens(got, want, want_logprobs)
    sizes = [len(c.token_ids) for c in calls if isinstance(c, (Prefill, Extend))]
    assert max(sizes) <= CHUNK, sizes
    resumed = {c.seq_id for c in calls if isinstance(c, Extend)} & set(preempted)
    assert resumed, "no preempted sequence was extended chunk by chunk"


@pytest.mark.parametrize("lengths,way", [([7] * 6, "cached"), ([10, 10, 10, 5, 7, 9], "scratch")])
def test_a_preempted_sequence_is_recomputed_from_the_prefix_cache(lengths, way):
    """A 48-token document is cached; then six questions about it (the document + `lengths` tokens) grow in a
    pool of 64 pages; each gets the tokens of a pool large enough for all. The scheduler's choices follow from
    the lengths alone (greedy, ignore_eos), so each layout takes one way: with 7-token questions the preempted
    one takes back what is left of its own pages (or copies the document from an entry); with these longer
    ones its pages are all taken before it resumes and the document's copy does not fit beside its source, so
    it is prefilled from nothing, having asked the prefix cache after its preemption."""
    doc = [random.randrange(256) for _ in range(48)]
    batches = [[("doc", doc)], [(f"r{i}", doc + [random.randrange(256) for _ in range(n)])
                                for i, n in enumerate(lengths)]]
    want, _, preempted, _ = _serve(_engine(kv_cache_tokens=4096), batches)
    want_logprobs = dict(_LOGPROBS)
    assert not preempted
    events = []                  # ("preempted", seq_id) and ("asked", ids, the longest cached prefix found), in order

    def spy(scheduler, runner):
        prefixes, preempt = scheduler.kv.prefixes, scheduler.preemptions.preempt

        def asked(ids, *rest, **kw):
            hits = prefixes(ids, *rest, **kw)
            events.append(("asked", ids, max((h.length for h in hits), default=0)))
            return hits
        scheduler.kv.prefixes = asked
        scheduler.preemptions.preempt = lambda seq, *rest: (events.append(("preempted", seq.seq_id)),
                                                            preempt(seq, *rest))

    got, calls, preempted, _ = _serve(_engine(kv_cache_tokens=256), batches, spy)
    assert preempted, "the pool was large enough for every question at once"
    _assert_same_tokens(got, want, want_logprobs)
    for seq_id in set(preempted):
        since = max(i for i, e in enumerate(events) if e == ("preempted", seq_id))
        freed = next((c for c in calls if isinstance(c, Free) and seq_id in c.seq_ids), None)
        later = calls[calls.index(freed):] if freed is not None else []
        cached = (any(isinstance(c, Reinstate) and seq_id in c.seq_ids for c in calls)
                  or any(isinstance(c, Adopt) and c.seq_id == seq_id and c.position >= len(doc) for c in later))
        assert cached == (way == "cached"), (seq_id, preempted, calls)
        if way == "scratch":
            question = batches[1][seq_id - 1][1]          # sequence 0 is the document, 1.. the questions in order
            found = [e[2] for e in events[since:] if e[0] == "asked" and e[1][:len(question)] == question]
            assert found and max(found) >= len(doc), (seq_id, found)    # found, but its copy did not fit


def test_a_preempted_sequence_takes_back_what_is_left_of_its_pages():
    """Three 40-token prompts in a pool of 28 pages of 4 tokens (one worker), two of them generating 30
    tokens: the newest is preempted as they grow; its pages stay as a prefix-cache entry whose tail the
    others' growth takes (an entry gives back pages from its tail, not all at once); when a request
    finishes, the preempted one takes back what is left and recomputes only the lost tail, with the
    tokens of a large pool."""
    batch = [("a", _prompts(1, 40, 41)[0][1], 30), ("b", _prompts(1, 40, 41)[0][1], 8),
             ("c", _prompts(1, 40, 41)[0][1], 30)]
    want, _, preempted, _ = _serve(_engine(kv_cache_tokens=4096), [batch])
    want_logprobs = dict(_LOGPROBS)
    assert not preempted
    got, calls, preempted, scheduler = _serve(_engine(kv_cache_tokens=112), [batch])
    _assert_same_tokens(got, want, want_logprobs)
    assert len(preempted) == 1, preempted
    victim = preempted[0]
    reinstated = calls.index(Reinstate([victim]))
    assert any(isinstance(c, Truncate) and c.seq_id == victim for c in calls[:reinstated]), "its tail was not taken"
    again = next(c for c in calls[reinstated:] if isinstance(c, (Extend, Prefill)) and c.seq_id == victim)
    assert isinstance(again, Extend) and again.start >= 16, again      # from the tokens it kept
    recomputed = scheduler.preemptions.recomputed_tokens
    assert 0 < recomputed < 40, recomputed           # only the lost tail

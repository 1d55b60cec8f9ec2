"""The KV manager's question `room_for` (engine/cache/kv_manager.py) against carrying its answer out: over
random prefix-cache entries on two workers, the evictions it plans free exactly enough (the need fits
after them, and not after all but the last), it answers None exactly when evicting every entry would not
do, and asking changes nothing."""
import copy
import random

from burstserve.engine.cache.kv_manager import KVManager
from burstserve.engine.cache.ledger import KVLedger
from burstserve.engine.cache.page_planner import PagePlanner
from burstserve.engine.cache.prefix_cache import BLOCK
from burstserve.engine.parallel import get_strategy


def _manager(rng: random.Random) -> KVManager:
    ledger = KVLedger(2, 4, num_pages=64)
    kv = KVManager(ledger, PagePlanner(get_strategy("burst", 2).placement, ledger, 64, 1 << 30), None, prefix_caching=True)
    for seq_id in range(rng.randrange(1, 6)):
        n = rng.randrange(1, 6) * BLOCK + rng.randrange(BLOCK)
        counts = [n // 2, n - n // 2]
        ledger.add(seq_id, counts, [[(0, counts[0])], [(counts[0], n)]])
        kv.prefix_cache.insert(seq_id, [rng.randrange(50) for _ in range(n)])
    room = [min(60, free * ledger.block_size) for free in kv.free_pages()]   # the pool refuses more than it has
    ledger.add(99, [rng.randrange(r + 1) for r in room], [[], []])   # a running sequence: never evicted
    return kv


def test_room_for_plans_exactly_the_evictions_that_make_room():
    rng = random.Random()
    for _ in range(200):
        kv = _manager(rng)
        need = [rng.randrange(0, 64), rng.randrange(0, 64)]
        keep = rng.choice([None, *kv.prefix_cache.entries])
        before = (copy.deepcopy(kv.ledger.seqs), list(kv.ledger.pages_used), list(kv.prefix_cache.entries))
        evictions = kv.room_for(need, keep_entry=keep)
        assert (copy.deepcopy(kv.ledger.seqs), list(kv.ledger.pages_used), list(kv.prefix_cache.entries)) == before
        evictable = [sum(kv.ledger.pages_of(e, r) for e in kv.prefix_cache.entries if e != keep) for r in range(2)]
        possible = all(n <= f + e for n, f, e in zip(need, kv.free_pages(), evictable))
        assert (evictions is not None) == possible, (need, kv.free_pages(), evictable)
        if evictions is None:
            continue
        assert all(e.seq_id != keep and e.keep % BLOCK == 0 for e in evictions)
        if evictions:
            kv_short = copy.deepcopy(kv)
            _carry_out(kv_short, evictions[:-1])
            assert not all(n <= f for n, f in zip(need, kv_short.free_pages())), "an eviction too many"
        _carry_out(kv, evictions)
        assert all(n <= f for n, f in zip(need, kv.free_pages())), (need, kv.free_pages(), evictions)
        for e in evictions:
            assert len(kv.prefix_cache.entries.get(e.seq_id, [])) == e.keep


def _carry_out(kv: KVManager, evictions) -> None:
    """kv.evict: it changes its own ledger (the one there is) and tells the workers (none here)."""
    kv.call = lambda message: None
    kv.evict(evictions)


def test_the_host_tiers_copies_are_what_worker_0_last_reported_and_what_was_issued_since():
    """The KV manager plans with the host tier's progress as a StepResult carries it (engine/cache/host_copies.py):
    a report replaces what it knew; a copy issued since runs until the next report, where copies run beside
    compute; on CPU (synchronous copies) nothing is ever pending."""
    from burstserve.engine.cache.host_copies import HostCopies
    from burstserve.engine.core.messages import HostProgress
    rng = random.Random()
    a, b, c = rng.sample(range(1000), 3)
    copies = HostCopies()
    copies.issued(storing=a, loading=b)                       # before any report: synchronous, nothing pending
    assert not copies.storing(a) and not copies.restoring(b) and not copies.stores_queued()
    copies.report(HostProgress(True, frozenset({b}), frozenset({a}), rng.randrange(1, 9)))
    assert copies.restoring(b) and copies.storing(a) and copies.stores_queued() and not copies.storing(c)
    copies.report(HostProgress(True, storing=frozenset({a})))
    copies.issued(storing=c)                                   # queued: an idle engine pumps it out
    assert copies.storing(c) and copies.storing(a) and copies.stores_queued()
    copies.report(HostProgress(True))                          # the next report: every copy done
    assert not any([copies.storing(a), copies.storing(c), copies.restoring(b), copies.stores_queued()])

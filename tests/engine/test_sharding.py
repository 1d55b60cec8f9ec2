"""Zigzag shards cover every position once and give every worker equal causal work at every step."""
import pytest

from burstserve.engine.core.placement import chunk_bounds, owner_of_position, whole_shards, zigzag_shards


@pytest.mark.parametrize("n,g", [(1, 1), (1, 4), (3, 2), (7, 4), (37, 3), (1000, 4), (4096, 8)])
def test_shards_cover_each_position_once(n, g):
    shards = zigzag_shards(n, g)
    positions = sorted(p for s in shards for p in s.positions().tolist())
    assert positions == list(range(n))
    for p in (0, n // 2, n - 1):
        rank, row = owner_of_position(shards, p)
        assert shards[rank].positions()[row].item() == p


def test_chunks_differ_by_at_most_one():
    sizes = [b - a for a, b in chunk_bounds(1003, 8)]
    assert sum(sizes) == 1003 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("g", [2, 4, 8])
def test_causal_work_is_balanced_at_every_ring_step(g):
    n = 64 * g
    shards = zigzag_shards(n, g)
    for step in range(g):
        work = []
        for r, s in enumerate(shards):
            keys = set(shards[(r - step) % g].positions().tolist())
            work.append(sum(1 for q in s.positions().tolist() for k in keys if k <= q))
        assert max(work) - min(work) <= max(work) * 0.02 + 64, (step, work)


def test_whole_shards_put_a_chunk_on_the_worker_holding_fewest_and_stay_level():
    """An incremental prefill run whole: all its tokens on one worker (fewest held, lowest rank on ties);
    chunk after chunk of random sizes the workers stay within one chunk of each other."""
    import random
    held = [5, 3, 3, 9]
    shards = whole_shards(7, held)
    assert [s.length for s in shards] == [0, 7, 0, 0]
    assert shards[1].positions().tolist() == list(range(7))
    assert owner_of_position(shards, 6) == (1, 6)
    largest = 0
    for _ in range(200):
        n = random.randrange(1, 300)
        largest = max(largest, n)
        held = [h + s.length for h, s in zip(held, whole_shards(n, held))]
        assert max(held) - min(held) <= max(largest, 9 - 3)

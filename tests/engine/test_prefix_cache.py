"""Prefix caching (--enable-prefix-caching): a prompt that extends a finished request's tokens
prefills only what is new (a copy of the cached prefix on every worker, then an incremental
prefill), and gives transformers' logits (<= 1e-4, fp32) and greedy tokens and the cold run's:
hits that end on a page boundary and inside one, the whole prompt cached, the cached sequence
longer than the new prompt; 1-4 CPU workers and every strategy keeping the zigzag layout. The index
never reuses a wrong prefix (hash collisions are checked against the tokens), and eviction under a
small pool keeps every answer right."""
import random

import pytest
import torch

from burstserve.engine import LLM, SamplingParams
from burstserve.engine.cache import prefix_cache
from burstserve.engine.cache.prefix_cache import BLOCK, PrefixCache
from burstserve.engine.pages.page_pool import PagePool
from hf_reference import hf_next_logits_and_greedy, save_checkpoint

GEN = 10
GREEDY = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3-gqa"))
    return path, save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))


def _exact(llm, model, prompt, cached_at_least):
    out = llm.generate(prompt, GREEDY)[0]
    ref_logits, ref_tokens = hf_next_logits_and_greedy(model, prompt, GEN)
    assert out.outputs[0].token_ids == ref_tokens, len(prompt)
    assert (out.metrics.prefill_stats.cached_tokens or 0) >= cached_at_least, out.metrics.prefill_stats
    return out


@pytest.mark.parametrize("workers,ring_min,extend_pass", [(1, 4096, "q"), (2, 4096, "q"), (3, 4096, "q"),
                                                         (4, 4096, "q"), (2, 0, "q"), (3, 0, "q"), (2, 0, "kv"),
                                                         (3, 0, "kv")])
def test_prompts_extending_cached_ones_match_transformers(checkpoint, workers, ring_min, extend_pass):
    """ring_min (extend_ring_min_tokens) 4096: the new tokens run whole on every worker; 0: over the ring,
    which sees the cached prefix (adopted from another sequence, unevenly over the workers) by passing the
    queries to it (extend_pass q) or its K/V around the ring (kv)."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    doc = [random.randrange(vocab) for _ in range(203)]
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32", block_size=16,
             enable_prefix_caching=True, extend_ring_min_tokens=ring_min, extend_pass=extend_pass) as llm:
        first = _exact(llm, model, doc, 0)                                   # cold: cached as doc + 9 generated
        cached = doc + first.outputs[0].token_ids[:-1]
        question = [random.randrange(vocab) for _ in range(37)]
        hit = _exact(llm, model, doc + question, len(doc))                   # hit inside a page, beyond the doc
        way = "local" if workers == 1 else ({"q": "ring", "kv": "ring-kv"}[extend_pass] if ring_min == 0 else "whole")
        assert hit.metrics.prefill_stats.extend_ways == {way: 1}
        _exact(llm, model, cached[:192] + question, 192)                     # hit on a page boundary
        _exact(llm, model, cached + first.outputs[0].token_ids[-1:], len(cached))   # a conversation's next turn
        _exact(llm, model, doc, len(doc) - 1)                                # the whole prompt cached
        _exact(llm, model, doc[:100], 99)                                    # the cached sequence is longer
        logits = llm.next_token_logits(doc + question)                      # another hit, logits compared
        ref_logits, _ = hf_next_logits_and_greedy(model, doc + question, 1)
        assert (logits - ref_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("strategy", ["burst-nolao", "ring-rsa", "ulysses", "tp", "auto", "cqs", "burst-zero"])
def test_every_strategy_with_prefix_hits(checkpoint, strategy):
    path, model = checkpoint
    vocab = model.config.vocab_size
    doc = [random.randrange(vocab) for _ in range(150)]
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", sp_strategy=strategy,
             enable_prefix_caching=True, max_num_batched_tokens=64) as llm:
        _exact(llm, model, doc, 0)
        _exact(llm, model, doc + [random.randrange(vocab) for _ in range(90)], len(doc))   # the rest in 2 chunks


def test_a_hash_collision_never_reuses_a_wrong_prefix(monkeypatch):
    """Every block hashes alike: the index proposes every entry, the token check keeps the right one."""
    monkeypatch.setattr(prefix_cache, "hash", lambda x: 7, raising=False)
    cache = PrefixCache()
    a = [random.randrange(1000) for _ in range(5 * BLOCK)]
    b = a[:2 * BLOCK] + [t + 1 for t in a[2 * BLOCK:]]
    cache.insert(1, a)
    cache.insert(2, b)                                       # more recent: proposed first
    assert cache.lookup(a[:4 * BLOCK] + [3]) == (1, 4 * BLOCK)
    assert cache.lookup(b[:3 * BLOCK + 5] + [10 ** 6]) == (2, 3 * BLOCK + 5)
    assert cache.lookup([10 ** 6] * 40) is None
    cache.remove(1)
    assert cache.lookup(a[:4 * BLOCK] + [3]) == (2, 2 * BLOCK)


def test_a_truncated_entry_is_found_only_as_far_as_it_still_holds():
    """An entry evicted from its tail (the scheduler keeps a prefix of whole blocks) answers lookups up to
    its new length; its dropped blocks leave the index; removing it afterwards leaves nothing behind."""
    cache = PrefixCache()
    a = [random.randrange(1000) for _ in range(6 * BLOCK + 5)]
    cache.insert(1, a)
    assert cache.lookup(a + [1]) == (1, len(a))
    cache.truncate(1, 2 * BLOCK)
    assert cache.entries[1] == a[:2 * BLOCK]
    assert cache.lookup(a + [1]) == (1, 2 * BLOCK)
    assert cache.lookup(a[:BLOCK + 3] + [10 ** 6]) == (1, BLOCK + 3)
    assert len(cache.index) == 2
    cache.remove(1)
    assert not cache.index and cache.lookup(a) is None


def test_ledger_and_pool_truncate_a_sequence_to_its_first_positions():
    """KVLedger.truncate keeps each worker's tokens before a position (its first slots: prefill shards,
    chunks and decoded tokens lie in position order) and PagePool.truncate gives back the pages after
    them; what is left is what a copy from the entry would take (held_before)."""
    import torch
    from burstserve.engine.cache.ledger import KVLedger
    from burstserve.engine.pages.page_pool import PagePool
    ledger = KVLedger(world_size=2, block_size=4, num_pages=20)
    ledger.add(7, [10, 10], [[(0, 5), (15, 20)], [(5, 15)]])       # a zigzag prefill of 20 tokens
    for _ in range(7):
        ledger.advance(7)                                           # decoded tokens 20..26, alternating
    held = [ledger.seqs[7].held_before(r, 17) for r in range(2)]
    assert held == [7, 10]
    assert ledger.seqs[7].tokens == [14, 13]                        # 4 pages each
    assert ledger.pages_freed_by_truncating(7, 17) == [4 - 2, 4 - 3]
    used = list(ledger.pages_used)
    assert ledger.truncate(7, 17) == held
    assert ledger.seqs[7].tokens == held and ledger.seqs[7].ranges == [[(0, 5), (15, 17)], [(5, 15)]]
    assert ledger.pages_used == [used[0] - 2, used[1] - 1]
    pool = PagePool(1, 20, 4, 1, 2, torch.float32, torch.device("cpu"), max_seqs=2, max_pages_per_seq=10)
    pool.add(7, 14)
    pool.retire(7)
    pool.truncate(7, 7)
    assert len(pool.pages[7]) == 2 and pool.lengths[7] == 7 and pool.free_pages == 18
    pool.reinstate(7)
    assert pool.table[pool.rows[7], :2].tolist() == pool.pages[7]


def test_the_ledger_picks_each_workers_pages_and_a_placed_pool_takes_only_those():
    """KVLedger picks every page a worker's tokens fill (lowest free ids first; what a truncation or a removal
    frees is free again, each page held by one sequence at a time), and a placed PagePool (the engine's) takes
    exactly the pages a call names: it refuses a page another sequence holds, too few, too many, or none."""
    import random
    import torch
    from burstserve.engine.cache.ledger import KVLedger
    from burstserve.engine.pages.page_pool import OutOfPagesError, PagePool
    rng = random.Random()
    ledger = KVLedger(world_size=2, block_size=4, num_pages=30)
    pools = [PagePool(1, 30, 4, 1, 2, torch.float32, torch.device("cpu"), max_seqs=80, max_pages_per_seq=30,
                      placed=True) for _ in range(2)]
    first = ledger.add(1, [5, 3], [[(0, 5)], [(5, 8)]])
    assert first == [[1, 2], [1]]                                            # lowest ids first
    for r in range(2):
        pools[r].add(1, [5, 3][r], first[r])
    live = {1}
    for step in range(60):                                                   # random growth, truncation, removal
        s = rng.choice(sorted(live) + [100 + step])
        if s not in live:
            counts = [rng.randrange(9), rng.randrange(9)]
            pages = ledger.add(s, counts, [[(0, counts[0])], [(counts[0], sum(counts))]])
            for r in range(2):
                pools[r].add(s, counts[r], pages[r])
            live.add(s)
        elif rng.random() < 0.5:
            owners, new = ledger.advance(s)
            for r, page in zip(owners, new):
                pools[r].append(s, page)
        elif rng.random() < 0.5:
            kept = ledger.truncate(s, rng.randrange(sum(ledger.seqs[s].tokens) + 1))
            for r in range(2):
                pools[r].truncate(s, kept[r])
        else:
            ledger.remove(s)
            for r in range(2):
                pools[r].free(s)
            live.discard(s)
        for r in range(2):
            held = [p for q in live for p in ledger.page_ids(q, r)]
            assert len(held) == len(set(held)) and ledger.free_pages()[r] == 30 - len(held) == pools[r].free_pages
            assert all(pools[r].pages[q] == ledger.page_ids(q, r) for q in live)
    pool = pools[0]
    free = [p for p in range(1, 31) if not pool.held._in_use[p]]
    held = [p for q in live for p in pool.pages[q]]
    wrong = [[free[0]], [free[0], free[1], free[2]], None, [0, free[0]]]      # too few, too many, none, scratch
    for i, pages in enumerate(wrong + ([[held[0], free[0]]] if held else [])):   # ... and one another holds
        with pytest.raises(OutOfPagesError, match="disagree"):
            pool.add(600 + i, 8, pages)
        assert 600 + i not in pool.pages and pool.free_pages == len(free)     # nothing taken


def test_eviction_under_a_small_pool_keeps_every_answer_right(checkpoint):
    """A pool of 3 prompts' worth: 10 distinct prompts and re-asks evict entries (least recently used
    first); every answer equals its solo cold answer, hits or not."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    prompts = [[random.randrange(vocab) for _ in range(random.randrange(40, 70))] for _ in range(10)]
    prompts += [p + [random.randrange(vocab) for _ in range(random.randrange(1, 30))] for p in prompts]   # extensions
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32") as llm:
        cold = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", block_size=4, kv_cache_tokens=128,
             enable_prefix_caching=True) as llm:
        hits = 0
        for i in list(range(10)) + [random.randrange(20) for _ in range(30)]:
            out = llm.generate(prompts[i], GREEDY)[0]
            assert out.outputs[0].token_ids == cold[i], i
            hits += (out.metrics.prefill_stats.cached_tokens or 0) > 0
        assert hits > 0


@pytest.mark.parametrize("workers", [1, 2])
def test_admission_evicts_other_entries_before_the_one_it_will_copy(checkpoint, workers):
    """A document is cached, then three other prompts finish (their entries more recently used); a
    question about the document needs pages: the others' entries are evicted, not the document's
    (least recently used), and the question copies the document's K/V."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    doc, *others = [[random.randrange(vocab) for _ in range(40 * workers)] for _ in range(4)]
    one = SamplingParams(temperature=0, max_tokens=1)
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32", block_size=4,
             kv_cache_tokens=192, enable_prefix_caching=True) as llm:     # 48 pages a worker, 40 taken below
        for prompt in [doc] + others:
            llm.generate(prompt, one)
        _exact(llm, model, doc + [random.randrange(vocab) for _ in range(6)], len(doc))


def test_a_hit_whose_prefix_sits_unevenly_extends_without_passing_a_workers_share(checkpoint):
    """A 1024-token prompt at max_model_len 1024 on 2 workers, then its first 768 tokens and 256 new:
    worker 1 holds 512 of the cached 768, so the new tokens go to worker 0 (level placement), and a
    copy that would not fit is never started."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    prompt = [random.randrange(vocab) for _ in range(1024)]
    second = prompt[:768] + [random.randrange(vocab) for _ in range(255)]
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", block_size=16, max_model_len=1024,
             enable_prefix_caching=True) as llm:
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
        out = llm.generate(second, SamplingParams(temperature=0, max_tokens=1))[0]
        assert out.metrics.prefill_stats.cached_tokens >= 768
        _, ref_tokens = hf_next_logits_and_greedy(model, second, 1)
        assert out.outputs[0].token_ids == ref_tokens


def test_cached_entries_count_as_free_in_the_usage_figures(checkpoint):
    """After a request finishes, its entry holds pages (kv_pages_free below full) but the in-use
    tokens (the KV usage gauge's source) return to 0 and the cached ones are reported apart."""
    from test_paged_decode import _wait_stats
    path, model = checkpoint
    prompt = [random.randrange(model.config.vocab_size) for _ in range(120)]
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", block_size=16,
             enable_prefix_caching=True) as llm:
        llm.generate(prompt, GREEDY)
        assert _wait_stats(llm, "kv_tokens_per_worker", [0, 0]) == [0, 0]
        cached = llm.stats.kv_tokens_cached_per_worker
        assert sum(cached) == len(prompt) + GEN - 1, cached
        assert all(free < llm.worker_facts[0].kv_pages_per_worker for free in llm.stats.kv_pages_free)


@pytest.mark.parametrize("max_runs,layerwise", [(0, 0), (64, 0), (64, 8)])
def test_a_prefix_copy_copies_every_page(monkeypatch, max_runs, layerwise):
    """PagePool.copy_prefix, run by run (every layer at once, or layer by layer) or gathering at most
    COPY_BYTES at a time (here 3 pages a batch): a 10-page prefix whose source pages are scattered in 4 runs
    (the last page partly used) is copied exactly, every layer, K and V."""
    import torch
    from burstserve.engine.pages import page_pool
    pool = page_pool.PagePool(num_layers=3, num_pages=40, block_size=4, num_kv_heads=2, head_dim=8,
                              dtype=torch.float32, device=torch.device("cpu"), max_seqs=4, max_pages_per_seq=16,
                              placed=True)                                # the pages named, as the KV manager does
    monkeypatch.setattr(page_pool, "COPY_BYTES", 3 * 4 * 2 * 8 * 4)       # 3 pages of one layer
    monkeypatch.setattr(page_pool, "MAX_RUN_COPIES", max_runs)
    monkeypatch.setattr(page_pool, "LAYERWISE_RUNS", layerwise)
    pool.k.normal_()
    pool.v.normal_()
    scattered = [2, 3, 30, 31, 9, 10, 11, 20, 21, 22]
    pool.add(1, 38, scattered)                                            # 10 pages, 38 tokens
    pool.copy_prefix(1, 2, 38, [1, 4, 5, 6, 7, 8, 12, 13, 14, 15])
    src, dst = pool.pages[1], pool.pages[2]
    assert src == scattered and len(dst) == 10 and not set(src) & set(dst)
    assert len(page_pool.page_runs(src, dst)) >= 4                          # several runs, not one
    assert torch.equal(pool.k[:, dst], pool.k[:, src]) and torch.equal(pool.v[:, dst], pool.v[:, src])


def test_page_pool_slots_follow_the_page_table_on_the_device_and_the_host():
    """slots() (computed on the device from the page table) and host_slots() name, token by token, the slot
    that slot() does, for random ranges of sequences whose pages were taken out of order."""
    rng = random.Random()
    pool = PagePool(1, 64, 16, 1, 8, torch.float32, torch.device("cpu"), 4, 64)
    pool.add(1, rng.randrange(1, 200))
    pool.add(2, rng.randrange(1, 300))
    pool.extend(1, rng.randrange(1, 200))                 # sequence 1's later pages come after sequence 2's
    for seq in (1, 2):
        n = pool.lengths[seq]
        for _ in range(50):
            start = rng.randrange(0, n)
            count = rng.randrange(0, n - start + 1)
            expected = torch.tensor([pool.slot(seq, i) for i in range(start, start + count)], dtype=torch.int64)
            assert torch.equal(pool.slots(seq, start, count), expected)
            assert torch.equal(pool.host_slots(seq, start, count), expected)

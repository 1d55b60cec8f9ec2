"""Chunked prefill (--max-num-batched-tokens): a prompt prefilled chunk by chunk, each chunk an
incremental prefill over the ones before it (engine/runner/extend_attention.py), gives transformers'
logits (<= 1e-4, fp32) and greedy tokens, for 1-4 CPU workers, chunk sizes that do and do not divide
the prompt and that end inside a page, every strategy; decode steps of other requests run between
the chunks and those requests still get their solo tokens. The prefix cache is off here (these
tests send a prompt again and count its chunks); chunks after a cached prefix: test_prefix_cache.py."""
import random
import time

import pytest

from burstserve.engine import LLM, SamplingParams
from burstserve.engine.runner.extend_graphs import ON_CPU_ENV
from hf_reference import assert_same_greedy, assert_same_logprobs, hf_next_logits_and_greedy, save_checkpoint

NUM_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3-gqa"))
    return path, save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))


def _check(llm, model, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref_logits, ref_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
        diff = (llm.next_token_logits(prompt) - ref_logits).abs().max().item()
        assert diff <= 1e-4, (len(prompt), diff)
        assert out.outputs[0].token_ids == ref_tokens, len(prompt)


# (workers, chunk, extend_ring_min_tokens, the ways of a (3 chunk + 5)-token prompt's 3 extends)
WAYS = [(1, 64, 4096, {"local": 3}), (2, 50, 4096, {"whole": 3}), (2, 128, 4096, {"whole": 3}),
        (3, 37, 4096, {"whole": 3}), (4, 100, 4096, {"whole": 3}),
        (2, 50, 0, {"ring": 3}), (3, 37, 0, {"ring": 3}), (4, 100, 0, {"ring": 3}),
        (3, 37, 6, {"ring": 2, "whole": 1})]                # chunks of 37 on the ring, the last 5 tokens whole


@pytest.mark.parametrize("workers,chunk,ring_min,ways", WAYS)
def test_chunked_prefill_matches_transformers(checkpoint, workers, chunk, ring_min, ways):
    """Every way of an incremental prefill (engine/runner/extend_attention.py): "local" on one worker, "whole"
    below extend_ring_min_tokens (every worker runs the chunk, one keeps its K/V), "ring" at or above it
    (with --extend-pass q: the queries passed to the cache; the default kv's "ring-kv" is the next test's)."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    lengths = [chunk + 1, 2 * chunk, 3 * chunk + 5, 401]      # 2 chunks (the last of 1 token), exact, uneven
    prompts = [[random.randrange(vocab) for _ in range(n)] for n in lengths]
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=workers, dtype="float32",
             max_num_batched_tokens=chunk, extend_ring_min_tokens=ring_min, extend_pass="q") as llm:
        _check(llm, model, prompts)
        stats = llm.generate(prompts[2], SamplingParams(max_tokens=1))[0].metrics.prefill_stats
        assert stats.chunks == 4 and stats.strategy == "extend" and stats.cached_tokens == 0
        assert stats.extend_ways == ways


@pytest.mark.parametrize("workers,chunk", [(2, 50), (3, 37), (4, 100)])
def test_ring_extends_that_pass_the_cached_kv_match_transformers(checkpoint, workers, chunk):
    """--extend-pass kv (the default): every sharded chunk's cached K/V goes around the ring with its new K/V
    (engine/parallel/pass_kv.py) rather than its queries to the cache, and the logits and greedy tokens are
    still transformers'; the chunks report the way "ring-kv". Prompts of 2 chunks (the last of one token:
    a worker with no new token passes the blocks on), exact chunks, and uneven ones."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    prompts = [[random.randrange(vocab) for _ in range(n)] for n in (chunk + 1, 2 * chunk, 3 * chunk + 5, 401)]
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=workers, dtype="float32",
             max_num_batched_tokens=chunk, extend_ring_min_tokens=0) as llm:
        _check(llm, model, prompts)
        stats = llm.generate(prompts[2], SamplingParams(max_tokens=1))[0].metrics.prefill_stats
        assert stats.chunks == 4 and stats.extend_ways == {"ring-kv": 3}, stats


@pytest.mark.parametrize("strategy", ["burst-nolao", "ring-rsa", "ulysses", "cqs", "tp", "auto", "burst-zero"])
def test_chunked_prefill_after_every_strategys_first_chunk(checkpoint, strategy):
    """The first chunk is a prefill by the configured strategy; the rest extend it."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    prompts = [[random.randrange(vocab) for _ in range(n)] for n in (97, 250)]
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=2, dtype="float32", sp_strategy=strategy,
             max_num_batched_tokens=40) as llm:
        _check(llm, model, prompts)
        if strategy == "burst-zero":         # its chunks run whole on the tp slices (no layer gathered)
            stats = llm.generate(prompts[1], SamplingParams(max_tokens=1))[0].metrics.prefill_stats
            assert stats.extend_ways == {"whole": 6}, stats


def test_requests_decode_between_the_chunks_of_a_long_prompt(checkpoint):
    """Short requests admitted before a long prompt keep decoding while it prefills in chunks, and
    every request gets the tokens it gets alone."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    short = [[random.randrange(vocab) for _ in range(n)] for n in (5, 20, 33)]
    long = [random.randrange(vocab) for _ in range(600)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=2, dtype="float32",
             enable_chunked_prefill=False) as llm:
        solo = [o.outputs[0].token_ids for o in llm.generate(short + [long], params)]
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=2, dtype="float32", max_num_batched_tokens=64,
             itl_target_ms=None) as llm:                                   # chunks of 64 whatever the timings
        outs = llm.generate(short + [long], params)
        for prompt, out, want in zip(short + [long], outs, solo):      # or they part at an fp32 near-tie (seen once
            assert_same_greedy(model, prompt, out.outputs[0].token_ids, want, len(prompt))   # in a 2-token cycle)
        assert outs[-1].metrics.prefill_stats.chunks == 10               # 600 tokens in chunks of 64
        assert all(o.metrics.prefill_stats.chunks is None for o in outs[:-1])


@pytest.mark.parametrize("workers,strategy,ring_min,graphs", [
    (1, "burst", 4096, False), (2, "burst", 4096, False), (3, "burst", 4096, False), (2, "burst", 0, False),
    (2, "tp", 4096, False), (1, "burst", 4096, True), (2, "burst", 4096, True), (2, "tp", 4096, True)])
def test_mixed_batch_runs_chunks_and_decode_steps_in_one_call(checkpoint, monkeypatch, workers, strategy, ring_min,
                                                              graphs):
    """--mixed-batch: a chunk after the first and the running requests' decode step are
    one forward pass; every request gets its solo tokens and logprobs (fp32, <= 1e-4), and the long
    prompt's chunks after the first went with decode steps; with --no-mixed-batch they did not. graphs: the
    same through the extend graphs' forward, uncaptured (engine/runner/extend_graphs.py; the 3 decode rows padded
    to the 8-row bucket; on 2 workers burst's chunk rows split over them, tp's run whole)."""
    if graphs:
        monkeypatch.setenv(ON_CPU_ENV, "1")
    path, model = checkpoint
    vocab = model.config.vocab_size
    short = [[random.randrange(vocab) for _ in range(n)] for n in (5, 20, 33)]
    long = [random.randrange(vocab) for _ in range(600)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    common = dict(devices="cpu", enable_prefix_caching=False, context_parallel_size=workers, dtype="float32",
                  sp_strategy=strategy, extend_ring_min_tokens=ring_min)
    with LLM(path, **common, enable_chunked_prefill=False) as llm:
        solo = [o.outputs[0] for o in llm.generate(short + [long], params)]
    for mixed in (True, False):
        with LLM(path, **common, max_num_batched_tokens=64, itl_target_ms=None, mixed_batch=mixed, max_num_seqs=8) as llm:
            outs = llm.generate(short + [long], params)
        for o, ref in zip(outs, solo):
            assert o.outputs[0].token_ids == ref.token_ids
            for got, want in zip(o.outputs[0].logprobs, ref.logprobs):
                assert_same_logprobs(got, want, 1e-4)
        stats = outs[-1].metrics.prefill_stats
        assert stats.chunks == 10 and stats.strategy == ("extend+decode" if mixed else "extend")
        assert stats.mixed_chunks == (9 if mixed else 0) and stats.graphed_extends == (9 if graphs else 0)


def test_chunked_prefill_preempts_for_room_and_aborts_return_every_page(checkpoint):
    """A small pool: decode steps between the chunks take the pages the next chunk needs, so the
    newest running request is preempted (and later completes with its solo tokens); a request
    aborted while its prompt is half prefilled gives back every page."""
    from test_paged_decode import _wait_stats
    path, model = checkpoint
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = [[random.randrange(vocab) for _ in range(n)] for n in (30, 35)]
    long = [random.randrange(vocab) for _ in range(200)]     # admitted with 5 pages a worker to spare; its 25
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=2, dtype="float32", block_size=4, kv_cache_tokens=160,
             max_num_batched_tokens=8) as llm:                  # chunks let the others grow by ~7 pages a worker
        pages = llm.worker_facts[0].kv_pages_per_worker
        solo = [llm.generate(p, params)[0].outputs[0].token_ids for p in short + [long]]
        together = llm.generate(short + [long], params)
        assert [o.outputs[0].token_ids for o in together] == solo
        assert _wait_stats(llm, "kv_pages_free", [pages, pages]) == [pages, pages]
        assert llm.stats.num_preemptions > 0, llm.stats
        rid = llm.submit([random.randrange(vocab) for _ in range(250)], params)   # 32 chunks
        deadline = time.time() + 10
        while sum(llm.stats.kv_tokens_per_worker) == 0 and time.time() < deadline:
            time.sleep(0.002)
        held = sum(llm.stats.kv_tokens_per_worker)
        llm.abort(rid)
        assert 0 < held < 250, held                     # aborted with part of the prompt in the cache
        assert _wait_stats(llm, "kv_pages_free", [pages, pages]) == [pages, pages]
        assert llm.generate(short[0], params)[0].outputs[0].token_ids == solo[0]


def test_many_small_chunks_stay_level_across_workers(checkpoint):
    """Chunks of 7 over 3 workers: each chunk's zigzag would give its leftover tokens to the same
    workers (43% of the prompt on worker 0, past its share of max_model_len); placed level, a prompt
    near max_model_len prefills and answers as transformers."""
    path, model = checkpoint
    prompt = [random.randrange(model.config.vocab_size) for _ in range(585)]     # + 12 generated <= 600
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=3, dtype="float32", max_model_len=600,
             max_num_batched_tokens=7) as llm:
        _check(llm, model, [prompt])


def test_a_prefilling_prompt_gives_way_to_a_running_request(checkpoint):
    """One worker, 8 pages of 4 tokens: a running request grows while a 20-token prompt prefills one
    token a chunk; when pages run out the prompt (the newer) is freed and prefilled again later,
    never the older request, and nothing raises. Both answer as alone."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    a = [random.randrange(vocab) for _ in range(4)]
    b = [random.randrange(vocab) for _ in range(20)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    with LLM(path, devices="cpu", enable_prefix_caching=False, dtype="float32", block_size=4, kv_cache_tokens=32,
             max_num_batched_tokens=1) as llm:
        solo = [llm.generate(p, q)[0].outputs[0].token_ids for p, q in zip((a, b), params)]
        together = llm.generate([a, b], params)
        assert [o.outputs[0].token_ids for o in together] == solo


def test_a_short_request_goes_before_the_next_chunk_of_a_long_prompt(checkpoint):
    """A long prompt prefilling in chunks does not hold back a short request that arrives with it: the
    short one is prefilled between two chunks and has its first token long before the long prompt has
    its own; both get the tokens they get alone."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    long = [random.randrange(vocab) for _ in range(600)]
    short = [random.randrange(vocab) for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=2, dtype="float32", max_num_batched_tokens=16) as llm:
        solo = [llm.generate(p, params)[0].outputs[0].token_ids for p in (long, short)]
        outs = llm.generate([long, short], params)              # the long one first in the queue
        assert [o.outputs[0].token_ids for o in outs] == solo
        long_metrics, short_metrics = outs[0].metrics, outs[1].metrics
        assert long_metrics.prefill_stats.chunks == 38      # 600 in chunks of 16 (the floor is the largest)
        assert short_metrics.first_token_time < long_metrics.first_token_time
        assert short_metrics.finished_time < long_metrics.first_token_time   # its 8 tokens during the chunks


def test_chunks_shrink_to_the_target_while_others_decode(checkpoint):
    """An unreachable --itl-target-ms: while a request decodes, the long prompt's chunks are the floor
    (engine.chunk_sizer.MIN_CHUNK_CPU on CPU); alone, the largest. Chunks of any size give transformers' tokens."""
    from burstserve.engine.scheduler.chunk_sizer import MIN_CHUNK, MIN_CHUNK_CPU
    path, model = checkpoint
    vocab = model.config.vocab_size
    long = [random.randrange(vocab) for _ in range(3 * MIN_CHUNK + 100)]
    short = [random.randrange(vocab) for _ in range(10)]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    busy = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with LLM(path, devices="cpu", enable_prefix_caching=False, context_parallel_size=2, dtype="float32", max_num_batched_tokens=2 * MIN_CHUNK,
             itl_target_ms=0.001) as llm:
        llm.generate(short, SamplingParams(max_tokens=1))             # a measured prefill for the cost model
        alone = llm.generate(long, params)[0]
        assert alone.metrics.prefill_stats.smallest_chunk == 100 + MIN_CHUNK          # 512 + 356
        assert alone.metrics.prefill_stats.largest_chunk == 2 * MIN_CHUNK
        outs = llm.generate([short, long], [busy, params])
        stats = outs[1].metrics.prefill_stats
        assert stats.largest_chunk == MIN_CHUNK_CPU and stats.chunks == -(-len(long) // MIN_CHUNK_CPU), stats
        ref_logits, ref_tokens = hf_next_logits_and_greedy(model, long, NUM_TOKENS)
        assert outs[1].outputs[0].token_ids == ref_tokens == alone.outputs[0].token_ids


def test_a_chunk_runs_whole_only_where_its_keeper_has_the_pages():
    """PagePlanner.extend_way over a ledger alone (no model): below extend_ring_min_tokens the chunk runs
    whole, kept by the worker holding fewest of the sequence, if that worker has the pages free; else it
    takes the ring and is placed level, which is also how every page plan places chunks."""
    from burstserve.engine.cache.ledger import KVLedger
    from burstserve.engine.cache.page_planner import PagePlanner
    from burstserve.engine.parallel import get_strategy
    ledger = KVLedger(2, 4, num_pages=10)
    pages = PagePlanner(get_strategy("burst", 2).placement, ledger, max_pages_per_seq=10, extend_ring_min_tokens=64)
    ledger.add(1, [8, 4], [[(0, 8)], [(8, 12)]])                 # 2 pages on worker 0, 1 on worker 1
    held = ledger.seqs[1].tokens
    assert pages.extend_way(64, held) == "ring"
    assert pages.extend_way(8, held) == "whole"
    assert [s.length for s in pages.extend_shards(held, 8, "whole")] == [0, 8]    # kept by worker 1
    assert [s.length for s in pages.extend_shards(held, 8, "ring")] == [2, 6]     # plans: level
    ledger.add(2, [0, 28], [[], [(0, 28)]])                      # another sequence: 7 pages of worker 1
    assert ledger.free_pages() == [8, 2]
    assert pages.extend_way(8, held) == "whole"                  # 2 more pages: exactly what is free
    assert pages.extend_way(9, held) == "ring"                   # 3: not free on worker 1, so level
    assert [s.length for s in pages.extend_shards(held, 9, pages.extend_way(9, held))] == [2, 7]
    assert pages.chunk_pages(1, 9) == [1, 2]                     # 8 + 2 = 10 tokens (3 pages), 4 + 7 = 11 (3)
    assert pages.extend_way(8, held, reserved=[0, 1]) == "ring"  # a decode step in the same call takes 1
    ledger.remove(2)
    pages.max_pages_per_seq = 2                                  # a sequence may hold 2 pages on a worker
    assert pages.extend_way(4, held) == "whole" and pages.extend_way(5, held) == "ring"


def test_whole_chunks_stay_within_a_sequences_pages_on_a_worker(checkpoint):
    """A prompt near max_model_len on 2 workers, chunks of 64: the pool lets one sequence hold a level share
    (129 tokens: 9 pages of 16) on a worker. Two chunks run whole (one per worker), the last would take its
    keeper to 154 tokens (10 pages), so it runs on the ring (passing the cached K/V), placed level;
    transformers' tokens."""
    path, model = checkpoint
    prompt = [random.randrange(model.config.vocab_size) for _ in range(250)]
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", max_model_len=256, block_size=16,
             kv_cache_tokens=4096, max_num_batched_tokens=64, itl_target_ms=None, enable_prefix_caching=False) as llm:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.metrics.prefill_stats.extend_ways == {"whole": 2, "ring-kv": 1}
    assert out.outputs[0].token_ids == hf_next_logits_and_greedy(model, prompt, 4)[1]

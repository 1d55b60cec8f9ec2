"""The KV host tier (--kv-offload-gb, engine/pages/host_pool.py): a finished request's K/V is copied to host
memory when it retires, and a prompt whose cached prefix has left the GPU pool gets it back from there.

With a GPU pool of a few documents, later documents evict the first from the pool; a question about it is
answered from the host tier (cached_tokens = the document, counted as a host hit), and its greedy tokens
and first-token logprobs equal transformers' (a full forward pass, no KV cache) on 1 and 2 workers, every
strategy, chunked prefill after the restore, FP8 pages and a tier smaller than one entry; a preempted
sequence whose pages the pool took comes back from the host tier (1 and 2 workers); the copies are
bit-exact; a tier larger than the host can give is refused at start with the figures, and 0 is no tier."""
import random

import pytest
import torch

from burstserve.engine import LLM, SamplingParams
from burstserve.engine.core.calls import Extend, Prefill, Restore
from burstserve.engine.core.errors import DeviceSpecError
from burstserve.engine.model.config import EngineConfig
from burstserve.engine.pages.host_memory import HOST_RESERVE, offload_gib, pinnable
from burstserve.engine.pages.host_pool import HostPool
from burstserve.engine.pages.page_pool import PagePool
from hf_reference import assert_same_greedy, assert_same_logprobs, hf_greedy, save_checkpoint
from scheduler_harness import serve_in_process

GEN = 6
DOC = 150            # tokens of a document: the pool below holds three of them
POOL = 256           # GPU pool tokens per worker
TIER = 0.01          # GiB per worker: dozens of documents of the test models
STRATEGIES = ["burst", "burst-nolao", "ring-rsa", "ulysses", "cqs", "tp", "tp-v3", "auto", "burst-zero"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3-gqa"))
    return path, save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))


def _params(logprobs: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=logprobs)


def _exact(model, prompt: list[int], out, what) -> None:
    """The request's greedy tokens and first-token logprobs against transformers without a KV cache."""
    tokens = out.outputs[0].token_ids
    assert_same_greedy(model, prompt, tokens, hf_greedy(model, prompt, GEN), what)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), use_cache=False).logits[0, -1].float()
    want = torch.log_softmax(logits, -1)
    got = out.outputs[0].logprobs[0]
    assert_same_logprobs(got, {t: want[t].item() for t in got}, 1e-4, what)


def _documents_then_questions(llm, model, docs: list[list[int]], what: str, question_len: int = 9) -> tuple:
    """Every document, then a question about the first (evicted from the pool by the others), checked
    against transformers -> (the question, its output)."""
    vocab = model.config.vocab_size
    for doc in docs:
        llm.generate(doc, _params())
    question = docs[0] + [random.randrange(vocab) for _ in range(question_len)]
    out = llm.generate(question, _params())[0]
    _exact(model, question, out, what)
    return question, out


@pytest.mark.parametrize("workers", [1, 2])
def test_a_document_evicted_from_the_pool_comes_back_from_host_memory(checkpoint, workers):
    path, model = checkpoint
    vocab = model.config.vocab_size
    docs = [[random.randrange(vocab) for _ in range(DOC * workers)] for _ in range(5)]
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32", block_size=16,
             kv_cache_tokens=POOL, kv_offload_gb=TIER) as llm:
        assert llm.worker_facts[0].kv_host_capacity_tokens > 10 * DOC
        _, out = _documents_then_questions(llm, model, docs, f"{workers} workers")
        stats = out.metrics.prefill_stats
        # the document, and a token more where the question's first equals the document's first answer token
        assert stats.cached_tokens == stats.host_cached_tokens in (len(docs[0]), len(docs[0]) + 1), stats
        assert llm.stats.prefix_cache_host_hits == stats.host_cached_tokens, llm.stats
        assert llm.stats.kv_offload_restored_bytes > 0 and llm.stats.kv_offload_stored_bytes > 0
        assert sum(llm.stats.kv_host_tokens_per_worker) >= 5 * len(docs[0]), llm.stats


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_restores_its_own_shards(checkpoint, strategy):
    """Two workers: each restores the slots it holds (zigzag shards, replicated tp, level extends), and the
    question's 40 new tokens run in two chunks (of at most 32) after the restore."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    docs = [[random.randrange(vocab) for _ in range(2 * DOC)] for _ in range(5)]
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", block_size=16, sp_strategy=strategy,
             kv_cache_tokens=2 * POOL if strategy.startswith("tp") else POOL, kv_offload_gb=TIER,
             max_num_batched_tokens=32, itl_target_ms=None) as llm:
        _, out = _documents_then_questions(llm, model, docs, strategy, question_len=40)
        stats = out.metrics.prefill_stats
        assert stats.host_cached_tokens in (len(docs[0]), len(docs[0]) + 1) and stats.chunks == 2, stats


def test_fp8_pages_and_their_scales_come_back_bit_exact(checkpoint):
    """FP8 pages (data and scales) restored from the host tier give the same tokens and logprobs as the
    same question answered from the pool (no tier, a pool large enough)."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    docs = [[random.randrange(vocab) for _ in range(2 * DOC)] for _ in range(5)]
    question = docs[0] + [random.randrange(vocab) for _ in range(9)]
    common = dict(devices="cpu", context_parallel_size=2, dtype="float32", block_size=16, kv_cache_dtype="fp8")
    with LLM(path, **common) as llm:
        llm.generate(docs[0], _params())
        want = llm.generate(question, _params())[0]
        assert want.metrics.prefill_stats.cached_tokens in (len(docs[0]), len(docs[0]) + 1)
    with LLM(path, kv_cache_tokens=POOL, kv_offload_gb=TIER, **common) as llm:
        for doc in docs:
            llm.generate(doc, _params())
        got = llm.generate(question, _params())[0]
    assert got.metrics.prefill_stats.host_cached_tokens == want.metrics.prefill_stats.cached_tokens, \
        got.metrics.prefill_stats
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
        assert_same_logprobs(a, b, 1e-6)


def test_a_tier_smaller_than_a_document_keeps_and_restores_its_first_blocks(checkpoint):
    """One worker, a pool of 320 tokens (one 300-token document) and a host tier of 192: each document's
    entry keeps its first 192 tokens in the tier (evicting the older one). A question about the last
    document does not fit beside its entry in the pool (a copy needs as many pages again), so it restores
    the tier's 192 tokens instead and prefills the rest."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    page_bytes = 16 * 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * \
        (model.config.hidden_size // model.config.num_attention_heads) * 4
    docs = [[random.randrange(vocab) for _ in range(2 * DOC)] for _ in range(2)]
    with LLM(path, devices="cpu", dtype="float32", block_size=16, kv_cache_tokens=320,
             kv_offload_gb=12 * page_bytes / 2**30) as llm:
        assert llm.worker_facts[0].kv_host_capacity_tokens == 192
        for doc in docs:
            llm.generate(doc, _params())
        assert llm.stats.kv_host_tokens_per_worker == [192], llm.stats
        question = docs[1] + [random.randrange(vocab) for _ in range(9)]
        out = llm.generate(question, _params())[0]
        _exact(model, question, out, "small tier, partial prefix")
        stats = out.metrics.prefill_stats
        assert stats.cached_tokens == stats.host_cached_tokens == 192, stats
        assert llm.stats.kv_host_evicted_tokens == 192, llm.stats


def test_a_preempted_sequence_comes_back_from_host_memory():
    """Three 40-token prompts growing by 70, 8 and 30 tokens in a pool of 32 pages of 4 tokens: the newest is
    preempted, the oldest's growth takes nearly all of its entry's pages, and on resume its K/V is restored
    from the host tier (not recomputed), with the tokens of a pool large enough for all."""
    def engine(**kw) -> EngineConfig:
        return EngineConfig(model="tiny", devices=["cpu"], dtype="float32", block_size=4, max_num_seqs=8,
                            max_num_batched_tokens=16, itl_target_ms=None, **kw)

    prompts = [[random.randrange(256) for _ in range(40)] for _ in range(3)]
    batch = [(rid, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
             for rid, p, n in zip("abc", prompts, (70, 8, 30))]
    want, _, _ = serve_in_process(engine(kv_cache_tokens=4096), [batch])
    preempted = []

    def spy(scheduler, runner):
        preempt = scheduler.preemptions.preempt
        scheduler.preemptions.preempt = lambda seq, *rest: (preempted.append(seq.seq_id), preempt(seq, *rest))

    got, calls, scheduler = serve_in_process(engine(kv_cache_tokens=128, kv_offload_gb=TIER), [batch], spy)
    assert {r: [o.token_id for o in v] for r, v in got.items()} == {r: [o.token_id for o in v] for r, v in want.items()}
    assert preempted, "nothing was preempted"
    restores = [c for c in calls if isinstance(c, Restore) and c.host_id in preempted]
    assert restores, [type(c).__name__ for c in calls]
    resumed = restores[0].seq_id
    first = next(c for c in calls[calls.index(restores[0]):] if isinstance(c, (Prefill, Extend)) and c.seq_id == resumed)
    assert isinstance(first, Extend) and first.start == restores[0].position >= 40, (first, restores[0])


def test_preempted_sequences_come_back_from_host_memory_on_two_workers(checkpoint):
    """The same on 2 workers through LLM: three prompts whose growth overfills a pool of 32 pages of 4 tokens
    a worker; sequences are preempted, and (no prompt sharing a prefix with another) every host hit is a
    preempted sequence's K/V coming back; every request's greedy tokens, and its last token's logprobs (read
    after any restore), equal transformers'."""
    path, model = checkpoint
    vocab = model.config.vocab_size
    prompts = [[random.randrange(vocab) for _ in range(80)] for _ in range(3)]
    lengths = (140, 16, 60)
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", block_size=4, max_num_seqs=8,
             max_num_batched_tokens=32, itl_target_ms=None, kv_cache_tokens=128, kv_offload_gb=TIER) as llm:
        outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)
                                      for n in lengths])
        stats = llm.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_host_hits > 0, stats
    for prompt, n, out in zip(prompts, lengths, outs):
        tokens = out.outputs[0].token_ids
        assert_same_greedy(model, prompt, tokens, hf_greedy(model, prompt, n), "preempted, 2 workers")
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens[:-1]]), use_cache=False).logits[0, -1].float()
        want = torch.log_softmax(logits, -1)
        got = out.outputs[0].logprobs[-1]
        assert_same_logprobs(got, {t: want[t].item() for t in got}, 1e-4, "preempted, 2 workers, last token")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("direct_runs", [16, 0])
def test_store_and_load_copy_every_page_bit_exact(fp8, direct_runs):
    """Pages scattered over the pool (runs and single pages) go to host memory and back into other pages,
    run by run or through a staging buffer (direct_runs 0), every tensor (FP8: data and scales) equal bit for
    bit; a freed entry gives its pages back."""
    pool = PagePool(3, 40, 4, 2, 8, torch.float32, torch.device("cpu"), max_seqs=4, max_pages_per_seq=40,
                    kv_cache_dtype="fp8" if fp8 else "auto")
    for t in pool._tensors():
        t.copy_(torch.randint(0, 255, t.shape, dtype=torch.uint8).view(t.dtype) if fp8 and t.dtype == torch.uint8
                else torch.randn(t.shape).to(t.dtype))
    pool.add(1, 3)                     # a page, so that sequence 2's pages do not start at page 1
    pool.add(2, 10 * 4)
    pool.free(1)
    pool.add(3, 5)
    pool.extend(2, 6)                  # sequence 2: 10 pages in a run, then pages after sequence 3's
    host = HostPool(pool, 16, direct_runs)
    host._free = [15, 14, 13, 12, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11][::-1]    # the entry's host pages in 2 runs
    stored = host.store(pool, 2, 2, 46)
    assert stored == 12 * host.page_bytes
    pool.add(4, 46)
    host.load(pool, 2, 4, 46)
    for t in pool._tensors():
        assert torch.equal(t[:, pool.pages[4]].view(torch.uint8), t[:, pool.pages[2]].view(torch.uint8))
    assert host.free_pages == 4
    host.free(2)
    assert host.free_pages == 16


def test_a_tier_the_host_cannot_give_is_refused_with_the_figures(tmp_path, checkpoint):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemAvailable:   20971520 kB\n")     # 20 GiB available
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(str(16 << 30))
    (cgroup / "memory.current").write_text(str(2 << 30))
    can, how = pinnable(str(meminfo), str(cgroup))
    assert can == (14 << 30) - HOST_RESERVE and "MemAvailable 20.0 GiB" in how and "14.0 GiB left" in how
    with pytest.raises(DeviceSpecError) as e:
        offload_gib(4, ["cuda:0", "cuda:1"], 2, str(meminfo), str(cgroup))
    assert "--kv-offload-gb 4 on 2 worker(s) asks 8.0 GiB" in str(e.value) and "at most 6.0 GiB" in str(e.value)
    assert offload_gib(3, ["cuda:0", "cuda:1"], 2, str(meminfo), str(cgroup)) == 3
    assert offload_gib(None, ["cuda:0"], 1, str(meminfo), str(cgroup)) == 1.5       # a quarter, by default
    assert offload_gib(None, ["cpu"], 2, str(meminfo), str(cgroup)) == 0             # none on CPU by default
    path, _ = checkpoint
    with pytest.raises(DeviceSpecError, match="--kv-offload-gb 100000"):
        LLM(path, devices="cpu", kv_offload_gb=100000)


def test_no_tier_by_default_on_cpu(checkpoint):
    path, model = checkpoint
    with LLM(path, devices="cpu", dtype="float32") as llm:
        assert llm.worker_facts[0].kv_host_capacity_tokens == 0
        llm.generate([1, 2, 3], _params())
        assert llm.stats.kv_host_capacity_per_worker == 0 and llm.stats.kv_offload_stored_bytes == 0

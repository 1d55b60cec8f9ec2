"""How a GPU worker's KV pool is sized (engine/pages/sizing.py), in numbers: without chunked prefill the
activations of a whole prompt's share are reserved; with --max-num-batched-tokens on flash-attn-4 only a
chunk's; and a prompt_logprobs request (prefilled in one call) longer than that reserve is refused by
name, while the same prompt without prompt_logprobs is served in chunks."""
import dataclasses
import random

import pytest

from burstserve.engine import LLM, InvalidRequestError, SamplingParams
from burstserve.engine.model.config import default_chunk_tokens, preset_config
from burstserve.engine.pages.sizing import (activation_bytes_per_token, fp8_gather_bytes, kv_bytes_per_token,
                                            mlp_piece_bytes, pass_q_bytes, pool_tokens_on_gpu, prefill_rows_reserved)
from burstserve.engine.parallel import get_strategy

GiB = 1 << 30


def test_rows_reserved_are_a_chunk_only_where_attention_reads_the_cache_in_place():
    share = 1 << 20
    assert prefill_rows_reserved(share, None, 64, 2048, gathers_context=False) == share       # one call
    assert prefill_rows_reserved(share, 8192, 64, 2048, gathers_context=True) == share        # dense gathers
    assert prefill_rows_reserved(share, 8192, 64, 2048, gathers_context=False) == 8192 + 64
    assert prefill_rows_reserved(share, 512, 16, 2048, gathers_context=False) == 2048 + 16    # the extend graphs
    assert prefill_rows_reserved(3000, 8192, 64, 2048, gathers_context=False) == 3000         # never above the share


def test_llama3_8b_on_one_h200_holds_twice_the_tokens_with_chunked_prefill():
    """The llama3-8b preset on one H200 (139.8 GiB) at --gpu-memory-utilization 0.9, 17 GiB of weights and
    CUDA context in use: a prompt's one-call prefill reserves ~74 KB of activations for each of its
    tokens (and 1.3 GiB for one piece of the MLP's), so KV and activations share the memory: ~560K
    tokens. With chunks of 8192 the pool takes all but one chunk's activations: ~880K tokens."""
    cfg = preset_config("llama3-8b")
    kv, act = kv_bytes_per_token(cfg, cfg.num_kv_heads, 2), activation_bytes_per_token(cfg, 2)
    mlp = mlp_piece_bytes(cfg, 2)
    assert kv == 131072 and 70_000 < act < 80_000 and mlp == 2 * 3 * 14336 * 16384
    budget = int(0.9 * 139.8 * GiB) - 17 * GiB - mlp
    one_call = pool_tokens_on_gpu(budget, kv, act, prefill_rows_reserved(1 << 20, None, 64, 2048, False))
    chunked = pool_tokens_on_gpu(budget, kv, act, prefill_rows_reserved(1 << 20, 8192, 64, 2048, False))
    assert one_call == budget // (kv + act)
    assert chunked == (budget - act * (8192 + 64)) // kv
    assert 550_000 < one_call < 575_000 and 860_000 < chunked < 900_000, (one_call, chunked)


def test_llama3_8b_with_fp8_pages_on_one_h200_holds_about_twice_the_tokens():
    """With --kv-cache-dtype fp8 (65 KiB a token) and chunks of 65536 the reserve is a chunk's activations
    plus one layer's K/V of a gather segment and a chunk in bf16 (3 bytes an element with the FP8 bytes:
    ~1.1 GiB, whatever the context) and one piece of the MLP's: the pool holds ~1.64M tokens, twice bf16's;
    with chunks of 16384, more."""
    from burstserve.kernels.paged_attention import FP8_GATHER_SEGMENT
    cfg = preset_config("llama3-8b")
    kv, act = kv_bytes_per_token(cfg, cfg.num_kv_heads, 2, "fp8"), activation_bytes_per_token(cfg, 2)
    assert kv == 66560
    budget = int(0.9 * 139.8 * GiB) - 17 * GiB - mlp_piece_bytes(cfg, 2)
    pools = {}
    for chunk in (65536, 16384):
        gather = fp8_gather_bytes(FP8_GATHER_SEGMENT + chunk, cfg.num_kv_heads, cfg.head_dim, 2)
        assert gather == (FP8_GATHER_SEGMENT + chunk) * 2 * 8 * (128 * 3 + 2) < 1.2 * GiB
        pools[chunk] = pool_tokens_on_gpu(budget - gather, kv, act, prefill_rows_reserved(1 << 20, chunk, 64, 2048, False))
        assert pools[chunk] == (budget - gather - act * (chunk + 64)) // kv
    bf16 = pool_tokens_on_gpu(budget, 2 * 65536, act, prefill_rows_reserved(1 << 20, 65536, 64, 2048, False))
    assert 1_600_000 < pools[65536] < pools[16384] < 1_800_000 and pools[65536] > 1.9 * bf16, (pools, bf16)


def test_llama3_8b_on_two_h200s_holds_a_million_tokens_under_the_default_chunk():
    """Two workers' default chunk is 131072 tokens (and so is four's or eight's). A worker reserves for all of
    a chunk's rows (a ring extend after an unevenly held prefix can put nearly all of it on one worker) and
    for its pass-Q (all its queries gathered, fp32 partials: ~7 GiB). The pool still takes over half a
    1M-token prompt a worker."""
    cfg = preset_config("llama3-8b")
    kv, act = kv_bytes_per_token(cfg, cfg.num_kv_heads, 2), activation_bytes_per_token(cfg, 2)
    chunk = default_chunk_tokens(get_strategy("burst", 2).kv_workers)
    assert chunk == 131072 == default_chunk_tokens(get_strategy("burst", 8).kv_workers)
    assert default_chunk_tokens(get_strategy("tp", 2).kv_workers) == 65536
    passq = pass_q_bytes(chunk, cfg.num_heads, cfg.head_dim, 2)
    assert passq == chunk * 32 * (128 * 2 + 4 * 128 + 8 * 129) and 6.5 * GiB < passq < 7.5 * GiB
    budget = int(0.9 * 139.8 * GiB) - 17 * GiB - mlp_piece_bytes(cfg, 2)
    rows = prefill_rows_reserved(1 << 19, chunk, 64, 2048, False)
    assert rows == chunk + 64
    pool = pool_tokens_on_gpu(budget - passq, kv, act, rows)
    assert pool == (budget - passq - act * rows) // kv
    assert 1_048_576 // 2 + 1 < pool < 800_000, pool


@pytest.mark.parametrize("workers", [1, 2])
def test_prompt_logprobs_longer_than_the_reserve_is_refused_and_served_without_them(workers):
    """CPU workers reserve nothing (prefill_rows_max None); set as a GPU worker with chunked prefill
    reports it, the engine refuses a prompt_logprobs prompt whose share on a worker exceeds it, before any
    work, and serves a shorter one with its prompt logprobs, and the long one without them."""
    with LLM("tiny", devices="cpu", context_parallel_size=workers, max_num_batched_tokens=64) as llm:
        assert llm.worker_facts[0].prefill_rows_max is None
        long_prompt = [random.randrange(250) for _ in range(300)]
        params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
        assert len(llm.generate(long_prompt, params)[0].prompt_logprobs) == 300     # no reserve: served
        llm.checks.facts = dataclasses.replace(llm.checks.facts, prefill_rows_max=100)
        share = 300 if workers == 1 else 151
        with pytest.raises(InvalidRequestError, match=f"prompt_logprobs needs the prompt prefilled in one call.*"
                                                      f"at most 100 tokens.*300 tokens would put {share} on one"):
            llm.generate(long_prompt, params)
        short = long_prompt[:99 * workers - 2 * (workers - 1)]
        out = llm.generate(short, params)[0]
        assert len(out.prompt_logprobs) == len(short) and len(out.outputs[0].token_ids) == 4
        plain = llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=4))[0]
        assert len(plain.outputs[0].token_ids) == 4 and plain.prompt_logprobs is None

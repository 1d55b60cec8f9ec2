"""Ring (BurstAttention) out and lse equal single-device attention, on fresh random inputs:
causal and not, uneven and empty shards, GQA, with and without overlap."""
import random

import pytest
import torch

from dist_harness import run_on_ranks
from burstserve.engine.core.placement import zigzag_shards
from burstserve.engine.parallel.burst_attention import BurstAttention
from burstserve.engine.parallel.ring import RingCommunicator
from burstserve.kernels.attention import reference_attention


def _ring_rank(rank, world_size, seq_len, heads, kv_heads, causal, overlap, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, heads, 16, generator=gen)
    kv = torch.randn(seq_len, 2, kv_heads, 16, generator=gen)
    shards = zigzag_shards(seq_len, world_size)
    pos = shards[rank].positions()
    ring = RingCommunicator(rank, world_size, torch.device("cpu"))
    attn = BurstAttention(ring, _backend(), shards, rank, 16 ** -0.5, overlap=overlap, causal=causal)
    out, lse = attn.forward(q[pos], kv[pos].contiguous())
    stats = ring.collect_stats()
    return pos, out, lse, stats.exchanges


def _backend():
    from burstserve.kernels.attention import AttentionBackend
    return AttentionBackend("reference", reference_attention)


@pytest.mark.parametrize("world_size,seq_len,heads,kv_heads,causal,overlap", [
    (2, 64, 4, 4, True, True),
    (2, 37, 4, 2, True, True),       # uneven chunks, GQA
    (3, 101, 6, 2, True, False),     # no overlap
    (4, 5, 4, 1, True, True),        # fewer tokens than 2G: empty chunks and an empty worker
    (3, 50, 4, 2, False, True),      # non-causal
    (4, 257, 8, 4, False, True),
])
def test_ring_matches_single_device(world_size, seq_len, heads, kv_heads, causal, overlap):
    seed = random.randrange(1 << 30)
    results = run_on_ranks(_ring_rank, world_size, seq_len, heads, kv_heads, causal, overlap, seed)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, heads, 16, generator=gen)
    kv = torch.randn(seq_len, 2, kv_heads, 16, generator=gen)
    ref_out, ref_lse = reference_attention(q, kv[:, 0], kv[:, 1], causal, 16 ** -0.5)
    covered = torch.cat([r[0] for r in results])
    assert sorted(covered.tolist()) == list(range(seq_len))
    for pos, out, lse, exchanges in results:
        torch.testing.assert_close(out, ref_out[pos], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse[pos], atol=1e-5, rtol=1e-5)
        assert exchanges == world_size - 1


def test_kv_view_is_the_stacked_message_without_a_copy():
    """burstserve.engine.runner.model_runner.kv_view: with no ring, K and V of a layer reach the attention as a view into
    the qkv projection's rows (v follows k there), and as a stack wherever they do not lie so."""
    from burstserve.engine.parallel import kv_view
    n, h, hkv, d = random.randint(1, 9), 4, 2, 8
    qkv = torch.randn(n, (h + 2 * hkv) * d)
    _, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    k, v = k.view(n, hkv, d), v.view(n, hkv, d)
    kv = kv_view(k, v)
    assert kv.data_ptr() == k.data_ptr() and torch.equal(kv, torch.stack([k, v], dim=1))
    qkv.add_(1.0)                                           # a view: it sees the rows change
    assert torch.equal(kv, torch.stack([k, v], dim=1))
    k2, v2 = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    swapped = kv_view(v, k)                                 # k after v: not that layout, stacked
    assert torch.equal(kv_view(k2, v2), torch.stack([k2, v2], dim=1))
    assert torch.equal(swapped, torch.stack([v, k], dim=1)) and swapped.data_ptr() != v.data_ptr()


def _fp8_ring_rank(rank, world_size, seq_len, causal, seed):
    from burstserve.kernels.kv_quant import round_kv
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, 4, 16, generator=gen)
    kv = round_kv(torch.randn(seq_len, 2, 2, 16, generator=gen) * 5)         # an FP8 cache's values
    shards = zigzag_shards(seq_len, world_size)
    pos = shards[rank].positions()
    ring = RingCommunicator(rank, world_size, torch.device("cpu"))
    sent = []
    exchange = ring.exchange
    ring.exchange = lambda send, recv: sent.append((send.dtype, tuple(send.shape[1:]))) or exchange(send, recv)
    results = []
    for fp8 in (True, False):
        attn = BurstAttention(ring, _backend(), shards, rank, 16 ** -0.5, causal=causal, fp8=fp8)
        results.append(attn.forward(q[pos], kv[pos].contiguous()))
    return results, sent


@pytest.mark.parametrize("world_size,seq_len,causal", [(2, 64, True), (3, 37, True), (4, 5, True), (3, 50, False)])
def test_an_fp8_ring_sends_fp8_bytes_and_attends_the_same_values(world_size, seq_len, causal):
    """--kv-cache-dtype fp8: the K/V block travels as [m, 2, Hkv, D + 2] uint8 (FP8 bytes, a bf16 scale a row),
    and each worker's out and lse are those of the bf16-message ring on the same (rounded) K/V, bit for bit."""
    seed = random.randrange(1 << 30)
    for (fp8_result, plain_result), sent in run_on_ranks(_fp8_ring_rank, world_size, seq_len, causal, seed):
        assert torch.equal(fp8_result[0], plain_result[0]) and torch.equal(fp8_result[1], plain_result[1])
        steps = world_size - 1
        assert sent == [(torch.uint8, (2, 2, 18))] * steps + [(torch.float32, (2, 2, 16))] * steps

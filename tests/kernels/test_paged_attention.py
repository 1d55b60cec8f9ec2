"""paged_attention against a plain dense reference written here: fp32 softmax over each sequence's
gathered keys with the end-aligned causal mask. Fresh random inputs each run."""
import random

import pytest
import torch

import kernels.paged_attention as pa
from kernels.paged_attention import choose_num_chunks, paged_attention


def make_case(q_lens, k_lens, h, hkv, d, bs, dtype=torch.float32, device="cpu", spare_blocks=3):
    """Sequences' blocks scattered in random order through a pool larger than needed; unused table
    slots point at random blocks (never read)."""
    needs = [(n + bs - 1) // bs for n in k_lens]
    max_blocks = max(needs + [1])
    num_blocks = sum(needs) + spare_blocks
    perm = torch.randperm(num_blocks).tolist()
    table = torch.randint(0, num_blocks, (len(k_lens), max_blocks), dtype=torch.int32)
    used = 0
    for b, nb in enumerate(needs):
        table[b, :nb] = torch.tensor(perm[used:used + nb], dtype=torch.int32)
        used += nb
    k_cache = torch.randn(num_blocks, bs, hkv, d, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, dtype=dtype)
    q = torch.randn(sum(q_lens), h, d, dtype=dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    lens = torch.tensor(k_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k_cache, v_cache, table, cu, lens)]


def dense_reference(q, k_cache, v_cache, table, cu, lens, scale, causal):
    """fp32, one query row at a time: softmax over the keys it sees, out 0 / lse -inf if none."""
    h, d = q.shape[1], q.shape[2]
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(q.shape[0], h, v_cache.shape[-1])
    lse = torch.full((q.shape[0], h), float("-inf"))
    for b in range(len(lens)):
        n, q0, q1 = int(lens[b]), int(cu[b]), int(cu[b + 1])
        slots = torch.arange(n)
        phys = table[b].long()[slots // bs]                                # physical block of each key
        k = k_cache[phys, slots % bs].float().repeat_interleave(h // hkv, dim=1)   # [n, H, D]
        v = v_cache[phys, slots % bs].float().repeat_interleave(h // hkv, dim=1)
        for i in range(q1 - q0):
            visible = n - (q1 - q0) + i + 1 if causal else n
            if visible <= 0:
                continue
            s = torch.einsum("hd,khd->hk", q[q0 + i].float(), k[:visible]) * scale   # [H, visible]
            lse[q0 + i] = torch.logsumexp(s, dim=-1)
            out[q0 + i] = torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), v[:visible])
    return out, lse


def check(case, scale, causal, atol=1e-4, **kw):
    out, lse = paged_attention(*case, scale, causal=causal, **kw)
    ref_out, ref_lse = dense_reference(*[t.cpu() for t in case], scale, causal)
    assert out.shape == case[0].shape and out.dtype == case[0].dtype
    assert lse.shape == case[0].shape[:2] and lse.dtype == torch.float32
    torch.testing.assert_close(out.float().cpu(), ref_out, atol=atol, rtol=atol)
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.cpu()[fin], ref_lse[fin], atol=atol, rtol=atol)
    return out, lse


@pytest.mark.parametrize("bs", [1, 16, 128])
@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2)])
def test_decode_mixed_lengths(bs, h, hkv):
    k_lens = [random.randint(1, 300) for _ in range(5)] + [1, bs, bs + 1]
    check(make_case([1] * len(k_lens), k_lens, h, hkv, 16, bs), 0.25, causal=True)


@pytest.mark.parametrize("bs", [1, 16, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_chunks_end_aligned(bs, causal):
    q_lens = [1, 7, 33, 130, 2]
    k_lens = [5, 7, 200, 130 + random.randint(0, 300), 2 + random.randint(0, 40)]   # new keys included
    check(make_case(q_lens, k_lens, 8, 2, 32, bs), 32 ** -0.5, causal)


def test_sequences_without_keys_or_queries():
    q_lens, k_lens = [3, 0, 1, 2, 4], [0, 9, 40, 0, 70]
    out, lse = check(make_case(q_lens, k_lens, 4, 2, 16, 16), 0.25, causal=True)
    assert (out[:3] == 0).all() and torch.isneginf(lse[:3]).all()
    assert (out[4:6] == 0).all() and torch.isneginf(lse[4:6]).all()


def test_fewer_keys_than_queries_causal():
    """Outside the usual contract (new keys included), still defined: early queries see nothing."""
    out, lse = check(make_case([6, 3], [4, 3], 4, 1, 16, 16), 0.25, causal=True)
    assert torch.isneginf(lse[:2]).all() and torch.isfinite(lse[2:]).all()


def test_bf16_inputs():
    case = make_case([1, 5, 1], [100, 64, 1], 8, 2, 64, 16, dtype=torch.bfloat16)
    check(case, 0.125, causal=True, atol=2e-2)


def _fake_fa4_call(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, scale, causal, max_seqlen_q):
    """flash_attn_varlen_func(page_table, seqused_k) has paged_attention's own contract (bottom-right
    causal): the reference stands in for it, so the split-and-merge indexing runs on CPU."""
    return paged_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, scale, causal,
                           backend="reference")


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 7])
@pytest.mark.parametrize("causal", [True, False])
def test_fa4_path_split_and_merge(monkeypatch, num_chunks, causal):
    monkeypatch.setattr(pa, "_fa4_call", _fake_fa4_call)
    q_lens, k_lens = [1, 4, 0, 1, 2], [700, 30, 5, 0, 1]
    check(make_case(q_lens, k_lens, 8, 2, 16, 16), 0.25, causal, backend="fa4", num_chunks=num_chunks)


def test_num_chunks_from_shapes():
    assert choose_num_chunks(1, 8, 128 * 1024, 132) == 16       # one 128K decode: fill the SMs
    assert choose_num_chunks(1, 8, 8192, 132) == 16
    assert choose_num_chunks(1, 8, 2048, 132) == 4               # chunks of at least 512 keys
    assert choose_num_chunks(16, 8, 8192, 132) == 1              # 128 CTAs already
    assert choose_num_chunks(64, 8, 2048, 132) == 1

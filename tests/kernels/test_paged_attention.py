"""paged_attention against a plain dense reference written here: fp32 softmax over each sequence's
gathered keys with the end-aligned causal mask. Fresh random inputs each run."""
import random

import pytest
import torch

import burstserve.kernels.paged_attention as pa
from burstserve.kernels import merge
from burstserve.kernels.merge import merge_stacked
from burstserve.kernels.paged_attention import choose_num_chunks, paged_attention
from triton_interpreter import run_interpreted


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


@pytest.mark.parametrize("causal", [True, False])
def test_fa4_rows_see_keys_skips_the_empty_row_pass(monkeypatch, causal):
    """rows_see_keys=True (every row sees a key): the kernel's result as it is, no row lookup; same values."""
    monkeypatch.setattr(pa, "_fa4_call", _fake_fa4_call)
    case = make_case([1, 4, 2], [700, 30, 2], 8, 2, 16, 16)
    expected = check(case, 0.25, causal, backend="fa4", num_chunks=1)
    monkeypatch.setattr(pa, "_row_visible_keys", _no_row_lookup)
    out, lse = check(case, 0.25, causal, backend="fa4", num_chunks=1, rows_see_keys=True)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


@pytest.mark.parametrize("cached,runs", [(700, 2), (700, 3), (64, 4), (129, 5)])
def test_split_prefix_attention_matches_one_causal_call(monkeypatch, cached, runs):
    """A chunk of 9 tokens after `cached` ones, its cached keys in runs of whole pages (one run may end
    inside a page whose rest the chunk's own keys fill): the same as attending causally over all keys."""
    monkeypatch.setattr(pa, "_fa4_call", _fake_fa4_call)
    m, bs = 9, 16
    q, k_cache, v_cache, table, cu, lens = make_case([m], [cached + m], 8, 2, 16, bs)
    pages = table[0].tolist()
    slots = torch.arange(cached, cached + m)
    phys = table[0].long()[slots // bs]
    k_new, v_new = k_cache[phys, slots % bs], v_cache[phys, slots % bs]               # the chunk's own K/V
    plan = pa.prefix_runs(pages, cached, bs, m, runs, torch.device("cpu"))
    assert (plan.used > 0).all() and int(plan.used.sum()) == cached and plan.used.shape[0] <= runs
    backend = pa.AttentionBackend("reference", pa.reference_attention)
    out, lse = pa.split_prefix_attention(q, k_new, v_new, k_cache, v_cache, plan, 0.25, backend)
    ref_out, ref_lse = dense_reference(q, k_cache, v_cache, table, cu, lens, 0.25, causal=True)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    out, lse = pa.split_prefix_attention(q, None, None, k_cache, v_cache, plan, 0.25, backend)   # the runs alone
    ref_out, ref_lse = dense_reference(q, k_cache, v_cache, table, cu, torch.tensor([cached]), 0.25, causal=False)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_prefix_run_count_from_shapes():
    assert pa.prefix_run_count(256, 4, 8, 131072, 132) == 2       # 64 CTAs: 2 runs of 64K keys
    assert pa.prefix_run_count(512, 4, 8, 131072, 132) == 1       # 128 CTAs already
    assert pa.prefix_run_count(128, 4, 8, 131072, 132) == 4
    assert pa.prefix_run_count(256, 4, 8, 40000, 132) == 1        # runs of at least MIN_RUN_KEYS
    assert pa.prefix_run_count(1, 4, 8, 1 << 20, 132) == pa.MAX_RUNS
    assert pa.prefix_run_count(384, 4, 8, 131072, 132) == 4       # 96 CTAs: 73% of a wave; 4 runs: 97% of 3
    assert pa.prefix_run_count(384, 4, 8, 100000, 132) == 1       # 3 runs at most: no count does better


def test_runs_fill_whole_waves_with_the_fewest_runs():
    """Every CTA count on 132 and 78 SMs: the choice keeps the SMs within WAVE_SLACK of the busiest
    choice, and no fewer runs would."""
    def busy(ctas, r, sms):
        return ctas * r / (-(-ctas * r // sms) * sms)
    for sms in (132, 78):
        for ctas in range(1, 600):
            r = pa.runs_filling_waves(ctas, sms, pa.MAX_RUNS)
            best = max(busy(ctas, k, sms) for k in range(1, pa.MAX_RUNS + 1))
            assert busy(ctas, r, sms) >= best - pa.WAVE_SLACK, (sms, ctas, r)
            assert all(busy(ctas, k, sms) < best - pa.WAVE_SLACK for k in range(1, r)), (sms, ctas, r)
    assert pa.runs_filling_waves(160, 132, 8) == 4 and pa.runs_filling_waves(1024, 132, 8) == 1
    assert pa.runs_filling_waves(96, 132, 1) == 1


def test_num_chunks_from_shapes():
    assert choose_num_chunks(1, 8, 128 * 1024, 132) == 16       # one 128K decode: fill the SMs
    assert choose_num_chunks(1, 8, 8192, 132) == 16
    assert choose_num_chunks(1, 8, 2048, 132) == 4               # chunks of at least 512 keys
    assert choose_num_chunks(16, 8, 8192, 132) == 1              # 128 CTAs already
    assert choose_num_chunks(64, 8, 2048, 132) == 1


# ---------------------------------------------------------------- max_seqlen_q (the decode fast path)

DECODE_K_LENS = [700, 30, 0, 1, 129, 2000]          # 0: a padding slot of a CUDA-graph batch


def test_decode_keyword_on_reference_backend():
    case = make_case([1] * len(DECODE_K_LENS), DECODE_K_LENS, 8, 2, 16, 16)
    for causal in (True, False):
        out, lse = check(case, 0.25, causal, max_seqlen_q=1)
        g_out, g_lse = paged_attention(*case, 0.25, causal=causal)
        assert torch.equal(out, g_out) and torch.equal(lse, g_lse)
        assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()


def test_max_seqlen_q_checked_on_gathered_paths():
    case = make_case([1, 3], [10, 20], 4, 2, 16, 16)
    check(case, 0.25, True, max_seqlen_q=3)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        paged_attention(*case, 0.25, max_seqlen_q=1)


def _no_row_lookup(*a, **k):
    raise AssertionError("the decode path must not look rows up")


@pytest.mark.parametrize("num_chunks", [None, 1, 2, 3, 7])
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_fa4_decode_path(monkeypatch, num_chunks, bs, causal):
    """max_seqlen_q=1, one row per sequence: no row lookup; split or not, equal to the generic path."""
    monkeypatch.setattr(pa, "_fa4_call", _fake_fa4_call)
    monkeypatch.setattr(pa, "num_sms", lambda device: 132)
    case = make_case([1] * len(DECODE_K_LENS), DECODE_K_LENS, 8, 2, 16, bs)
    generic = paged_attention(*case, 0.25, causal=causal, backend="fa4", num_chunks=num_chunks)
    monkeypatch.setattr(pa, "_row_visible_keys", _no_row_lookup)
    out, lse = check(case, 0.25, causal, backend="fa4", num_chunks=num_chunks, max_seqlen_q=1)
    torch.testing.assert_close(out, generic[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, generic[1], atol=1e-5, rtol=1e-5)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()


def test_fa4_decode_single_long_sequence(monkeypatch):
    """One row (the 1 x 128K shape, scaled down): q repeated as a stride-0 view; chunk counts that
    divide the table and that do not."""
    seen = []
    monkeypatch.setattr(pa, "_fa4_call", lambda q, *a: seen.append(q.stride()) or _fake_fa4_call(q, *a))
    for n, c in ((4096, 8), (4000, 8), (4096, 5)):
        case = make_case([1], [n], 8, 2, 16, 128, spare_blocks=0)
        check(case, 0.25, True, backend="fa4", num_chunks=c, max_seqlen_q=1)
        assert seen[-1][0] == 0


def test_split_width_follows_each_rows_length(monkeypatch):
    """The table's capacity is far larger than the rows' keys (a CUDA graph's batch is captured for
    max_model_len): each row's own keys are still split c ways, each chunk's table row starts at its
    first page, and the chunk tables sit behind a readable guard entry."""
    seen = []
    monkeypatch.setattr(pa, "_fa4_call", lambda q, k, v, table, cu, used, *a: seen.append((table, used))
                        or _fake_fa4_call(q, k, v, table, cu, used, *a))
    lens = [1000, 0, 130, 16 * 64]
    case = make_case([1] * 4, lens, 8, 2, 16, 16, spare_blocks=0)
    q, kc, vc, table, cu, k_lens = case
    wide = torch.randint(0, kc.shape[0], (4, 400), dtype=torch.int32)     # capacity 6400 keys a row
    wide[:, :table.shape[1]] = table
    check([q, kc, vc, wide, cu, k_lens], 0.25, False, backend="fa4", num_chunks=4, max_seqlen_q=1)
    chunk_table, used = seen[-1]
    assert used.view(4, 4).tolist() == [[256, 256, 256, 232], [0] * 4, [48, 48, 34, 0], [256] * 4]
    assert chunk_table.shape == (16, 100) and chunk_table.storage_offset() >= 1
    assert chunk_table[1, :16].tolist() == table[0, 16:32].tolist()          # row 0, chunk 1: pages 16..31
    assert chunk_table[3, :15].tolist() == table[0, 48:63].tolist()
    assert chunk_table[13, :4].tolist() == wide[3, 16:20].tolist()           # row 3, chunk 1: pages 16..19


def test_guarded_table_has_a_readable_entry_before_it():
    t = torch.randint(0, 9, (3, 5), dtype=torch.int32)
    g = pa.guarded_table(t)
    assert torch.equal(g, t) and g.storage_offset() == 1 and g.untyped_storage()[0] == 0
    assert pa.guarded_table(g) is g


def test_split_merge_ignores_garbage_in_empty_chunks():
    """The split's merge (torch path): chunks with used == 0 hold NaN/inf garbage; the result is the
    exact merge of the others, and a row whose chunks are all empty gives out 0, lse -inf."""
    r, c, h, d = 3, 4, 2, 8
    used = torch.tensor([[5, 0, 3, 0], [0, 0, 0, 0], [1, 2, 3, 4]], dtype=torch.int32)
    out = torch.randn(r, c, h, d)
    lse = torch.randn(r, c, h)
    ref = [merge_stacked(out[i][used[i] > 0], lse[i][used[i] > 0]) for i in (0, 2)]
    out[used == 0] = float("nan")
    lse[used == 0] = torch.tensor([float("inf"), float("nan")])
    o, l = pa._split_merge(out.view(r * c, h, d), lse.view(r * c, h), used.view(-1), r, c, torch.float32)
    for i, (ro, rl) in zip((0, 2), ref):
        torch.testing.assert_close(o[i], ro, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(l[i], rl, atol=1e-6, rtol=1e-6)
    assert (o[1] == 0).all() and torch.isneginf(l[1]).all()


def test_split_inputs_torch_path():
    q = torch.randn(2, 4, 8)
    table = torch.arange(20, dtype=torch.int32).view(2, 10)
    q_rep, used, chunks = pa._split_inputs(q, torch.tensor([300, 0], dtype=torch.int32), table, 3, 128)
    assert used.tolist() == [128, 128, 44, 0, 0, 0] and used.dtype == torch.int32   # 3 pages: 1 a chunk
    assert torch.equal(q_rep, q.repeat_interleave(3, dim=0))
    assert chunks.tolist()[:3] == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]] and chunks.storage_offset() == 1
    q_rep, used, chunks = pa._split_inputs(q[:1], torch.tensor([1200], dtype=torch.int32), table[:1], 3, 128)
    assert used.tolist() == [512, 512, 176] and q_rep.stride(0) == 0 and torch.equal(q_rep, q[:1].expand(3, 4, 8))
    assert chunks.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]      # 10 pages: 4 a chunk, 0 past the end


def test_shape_constants_cached():
    a = pa._cached(torch.device("cpu"), ("test", 3), lambda: torch.arange(3))
    b = pa._cached(torch.device("cpu"), ("test", 3), lambda: torch.arange(5))
    assert a is b


def _kernel_launches(fn):
    """aten ops that launch a kernel on a GPU (views, allocations and metadata left out)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    skip = {"view", "expand", "transpose", "slice", "unsqueeze", "squeeze", "select", "as_strided", "_unsafe_view",
            "alias", "t", "permute", "detach", "empty", "empty_strided", "empty_like", "scalar_tensor",
            "lift_fresh", "_local_scalar_dense"}
    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in skip:
                ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return ops


def test_decode_split_kernel_count(monkeypatch):
    """The torch fallback of the decode split (1 row): chunk lengths and tables ~22, flash-attn-4 1, merge 15."""
    def fake(q, k_cache, v_cache, page_table, cu, used, scale, causal, max_seqlen_q):
        return torch.empty(q.shape, dtype=q.dtype), torch.empty(q.shape[1], q.shape[0]).t()
    monkeypatch.setattr(pa, "_fa4_call", fake)
    case = make_case([1], [8192], 8, 2, 16, 128, dtype=torch.bfloat16, spare_blocks=0)
    run = lambda **kw: paged_attention(*case, 0.25, backend="fa4", num_chunks=16, **kw)  # noqa: E731
    run(max_seqlen_q=1)                                      # shape constants cached
    decode = _kernel_launches(lambda: run(max_seqlen_q=1))
    assert len(decode) <= 40, decode
    assert len(_kernel_launches(run)) > len(decode)


# ---------------------------------------------------------------- the Triton split kernels, interpreted on CPU

def _triton_interpreted_checks():
    """The split path's Triton kernels (the prep here, the merge kernels/merge.py's) against the torch path,
    on CPU through Triton's interpreter. Needs TRITON_INTERPRET=1 from before triton's first import (its
    own jit'd functions, tl.max & co, are decided then): test_triton_split_kernels_interpreted runs this
    in a fresh process. The merge kernels' own checks: tests/kernels/test_merge.py."""
    import warnings
    warnings.simplefilter("ignore", RuntimeWarning)          # numpy: exp/log of -inf in masked lanes
    prep, merges = pa._build()["prep"], merge._build()
    assert type(prep).__name__ == "InterpretedFunction", type(prep)
    q = torch.randn(3, 4, 16)
    visible = torch.tensor([0, 300, 1000], dtype=torch.int32)
    table = torch.randint(1, 100, (3, 70), dtype=torch.int32)
    for rows in (q, q[1:2]):                                 # copy for several rows, stride-0 view for one
        vis = visible[:rows.shape[0]].contiguous()
        tab = table[:rows.shape[0]]
        q_rep, used, chunks = pa._split_inputs_triton(prep, rows, vis, tab, 5, 16)
        t_rep, t_used, t_chunks = pa._split_inputs(rows, vis, tab, 5, 16)
        assert torch.equal(used, t_used) and torch.equal(q_rep, t_rep) and q_rep.stride() == t_rep.stride()
        assert torch.equal(chunks, t_chunks) and chunks.storage_offset() == 1 and chunks.untyped_storage()[0] == 0
    used = pa._split_inputs(q, visible, table, 5, 16)[1]
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.randn(15, 4, 16).to(dtype)
        lse = torch.randn(4, 15).t()                         # flash-attn-4's [H, total_q], transposed
        out[used == 0] = float("nan")                        # garbage in the empty chunks
        lse[used == 0] = float("inf")
        t_o, t_l = pa._split_merge(out, lse, used, 3, 5, dtype)          # the torch ops (CPU)
        merge._triton.kernels = lambda device: merges
        o, l = pa._split_merge(out, lse, used, 3, 5, dtype)              # the merge kernel
        del merge._triton.kernels
        assert o.dtype == dtype and l.dtype == torch.float32
        rtol = 1e-5 if dtype == torch.float32 else 1e-2      # bf16: fp32 results one rounding apart
        torch.testing.assert_close(o.float(), t_o.float(), atol=1e-5, rtol=rtol)
        torch.testing.assert_close(l, t_l, atol=1e-5, rtol=1e-5)
        assert (o[0] == 0).all() and torch.isneginf(l[0]).all()
    # device_prefix_runs through the prep kernel: prefix_runs' tables and counts, empty runs after them
    row = torch.randint(1, 100, (1, 70), dtype=torch.int32)
    for cached in (1, 300, 1000):
        t_tab, t_used = pa._split_inputs(q[:1], torch.tensor([cached], dtype=torch.int32), row, 4, 16)[2:0:-1]
        tab, used4 = pa._split_inputs_triton(prep, q[:1], torch.tensor([cached], dtype=torch.int32), row, 4, 16)[2:0:-1]
        assert torch.equal(tab, t_tab) and torch.equal(used4, t_used)
        ref = pa.prefix_runs(row[0].tolist(), cached, 16, 1, 4, torch.device("cpu"))
        assert torch.equal(used4[:ref.used.shape[0]], ref.used) and (used4[ref.used.shape[0]:] == 0).all()
    # the whole fa4 path through the kernels (flash-attn-4 itself replaced by the reference)
    pa._fa4_call = _fake_fa4_call
    pa._triton.kernels = lambda device: {"prep": prep}
    merge._triton.kernels = lambda device: merges
    for max_seqlen_q in (None, 1):
        check(make_case([1] * len(DECODE_K_LENS), DECODE_K_LENS, 8, 2, 16, 16), 0.25, True, backend="fa4",
              num_chunks=3, max_seqlen_q=max_seqlen_q)
        check(make_case([1], [1000], 8, 2, 16, 16), 0.25, True, backend="fa4", num_chunks=4,
              max_seqlen_q=max_seqlen_q)
    check(make_case([1, 4, 0, 1, 2], [700, 30, 5, 0, 1], 8, 2, 16, 16), 0.25, True, backend="fa4", num_chunks=3)
    assert pa._triton.enabled and merge._triton.enabled, "a kernel failed and the torch ops served"


def test_triton_split_kernels_interpreted():
    run_interpreted("test_paged_attention")

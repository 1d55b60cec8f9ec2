"""kernels/merge.py, the LSE merge: partials over blocks of keys merge to softmax attention over all the
keys, computed independently here in float64 (fresh random inputs each run); empty partials (lse -inf)
and masked ones (used == 0, holding garbage) weigh nothing. The same checks run through the Triton
kernels on the CPU, in Triton's interpreter (test_merge_triton_kernels_interpreted)."""
import torch

from burstserve.kernels import merge
from burstserve.kernels.merge import merge_into, merge_partials, merge_stacked
from triton_interpreter import run_interpreted

SCALE = 0.3
CUTS = (0, 9, 9, 20, 33)          # four blocks of keys, the second empty


def _attention64(q, k, v, scale=SCALE):
    """Softmax attention in float64: q [n, H, D], k, v [m, H, D] -> (out [n, H, D], lse [n, H]); m = 0 gives
    out 0, lse -inf."""
    s = torch.einsum("nhd,mhd->hnm", q.double(), k.double()) * scale         # [H, n, m]
    lse = torch.logsumexp(s, dim=-1)                                         # [H, n]
    out = torch.einsum("hnm,mhd->nhd", torch.exp(s - lse[..., None]), v.double())
    return out, lse.t()


def _case(n=7, h=4, d=16, cuts=CUTS, magnitude=1.0):
    """-> (q, k, v, the partials over each block of keys [(out [n, H, D] fp32, lse [n, H] fp32)])."""
    q, k, v = torch.randn(n, h, d) * magnitude, torch.randn(cuts[-1], h, d) * magnitude, torch.randn(cuts[-1], h, d)
    parts = [_attention64(q, k[a:b], v[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    return q, k, v, [(o.float(), l.float()) for o, l in parts]


def _keys(k, v, blocks, cuts=CUTS):
    """The keys and values of the listed blocks, concatenated."""
    pick = torch.cat([torch.arange(cuts[b], cuts[b + 1]) for b in blocks]).long()
    return k[pick], v[pick]


def _close(out, lse, want, dtype=torch.float32):
    """out, lse against a float64 (out, lse): fp32 rounding, or one bf16 rounding of out."""
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want[0], **tol)
    torch.testing.assert_close(lse.double(), want[1], atol=2e-5, rtol=2e-6)


# ---------------------------------------------------------------- merge_into (pairwise, in place)

def test_merge_into_equals_attention_over_all_keys():
    """An accumulator starting empty (0, -inf) absorbs the blocks one by one, the empty one included;
    fp32 and bf16 accumulators, the partials in the accumulator's dtype."""
    q, k, v, parts = _case()
    for dtype in (torch.float32, torch.bfloat16):
        out, lse = torch.zeros(7, 4, 16, dtype=dtype), torch.full((7, 4), float("-inf"))
        for o, l in parts:
            merge_into(out, lse, o.to(dtype), l)
        _close(out, lse, _attention64(q, k, v), dtype)


def test_merge_into_rows_of_an_accumulator_with_transposed_lses():
    """As BurstAttention calls it: rows 3: of the accumulator, lses as flash attention gives them ([H, R]
    transposed); rows before 3 untouched."""
    q, k, v, parts = _case(n=9)
    (a, la), (b, lb) = parts[0], parts[2]
    acc, acc_lse = a.clone(), la.t().contiguous().t()
    merge_into(acc[3:], acc_lse[3:], b[3:], lb[3:].t().contiguous().t())
    _close(acc[3:], acc_lse[3:], _attention64(q[3:], *_keys(k, v, [0, 2])))
    assert torch.equal(acc[:3], a[:3]) and torch.equal(acc_lse[:3], la[:3])


def test_merge_into_with_empty_sides_never_gives_nan():
    """A row whose accumulator is empty takes the block as it is; a row where both are empty stays 0, -inf."""
    q, k, v, parts = _case()
    (a, la), (b, lb) = parts[0], parts[2]
    for dtype in (torch.float32, torch.bfloat16):
        acc, acc_lse = a.clone().to(dtype), la.clone()
        blk, blk_lse = b.clone(), lb.clone()
        acc[1], acc_lse[1] = 0.0, float("-inf")                                   # row 1: only the block
        acc[2], acc_lse[2], blk[2], blk_lse[2] = 0.0, float("-inf"), 0.0, float("-inf")   # row 2: neither
        merge_into(acc, acc_lse, blk.to(dtype), blk_lse)
        assert not acc.isnan().any() and (acc[2] == 0).all() and torch.isneginf(acc_lse[2]).all()
        _close(acc[1], acc_lse[1], tuple(t[1] for t in _attention64(q, *_keys(k, v, [2]))), dtype)
        _close(acc[3:], acc_lse[3:], tuple(t[3:] for t in _attention64(q, *_keys(k, v, [0, 2]))), dtype)


def test_merge_into_a_bf16_output_rounds_once():
    """A bf16 accumulator absorbs a partial with fp32 arithmetic: the fp32 merge of its values, rounded once."""
    _, _, _, parts = _case()
    (a, la), (b, lb) = parts[0], parts[2]
    out, lse = a.bfloat16(), la.clone()
    merge_into(out, lse, b.bfloat16(), lb)
    fp32_of_bf16_inputs, fp32_lse = a.bfloat16().float(), la.clone()
    merge_into(fp32_of_bf16_inputs, fp32_lse, b.bfloat16().float(), lb)
    assert out.dtype == torch.bfloat16 and torch.equal(out, fp32_of_bf16_inputs.bfloat16())
    assert torch.equal(lse, fp32_lse)


# ---------------------------------------------------------------- merge_partials (P stacked partials)

def test_merge_partials_equals_attention_over_all_keys():
    """The partials as views into one gathered [P, R, H, D + 1] buffer, lse in the last column (as
    merge_over_workers packs them), out in fp32 or bf16."""
    q, k, v, parts = _case()
    gathered = torch.stack([torch.cat([o, l[..., None]], dim=-1) for o, l in parts])   # [4, 7, 4, 17]
    for dtype in (torch.float32, torch.bfloat16):
        out, lse = merge_partials(gathered[..., :-1], gathered[..., -1], dtype)
        _close(out, lse, _attention64(q, k, v), dtype)


def test_merge_partials_never_reads_unused_partials():
    """used [P]: partials with used 0 hold NaN / inf and weigh 0, the result is attention over the other
    partials' keys; none used: out 0, lse -inf."""
    q, k, v, parts = _case()
    outs, lses = torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts])   # [4, 7, 4, 16], [4, 7, 4]
    outs[2], lses[2] = float("nan"), float("inf")
    outs[3], lses[3] = float("inf"), float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        out, lse = merge_partials(outs, lses, dtype, torch.tensor([5, 1, 0, 0], dtype=torch.int32))
        _close(out, lse, _attention64(q, *_keys(k, v, [0, 1])), dtype)
        out, lse = merge_partials(outs, lses, dtype, torch.zeros(4, dtype=torch.int32))
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_merge_partials_with_a_used_count_per_row():
    """used [P, R] (the paged split's chunks: [c, R] views of [R, c] counts): each row merges its own
    partials; a row with none gets out 0, lse -inf."""
    q, k, v, parts = _case(n=4)
    outs = torch.stack([o for o, _ in parts], dim=1).transpose(0, 1)         # [4, R, H, D] views of [R, 4, ...]
    lses = torch.stack([l for _, l in parts], dim=1).transpose(0, 1)
    rows_use = [[0, 2, 3], [], [3], [0, 1, 2, 3]]
    used = torch.tensor([[int(p in use) for p in range(4)] for use in rows_use], dtype=torch.int32)   # [R, 4]
    garbage = used.t()[..., None].expand(4, 4, 4) == 0
    outs, lses = outs.masked_fill(garbage[..., None], float("nan")), lses.masked_fill(garbage, float("inf"))
    out, lse = merge_partials(outs, lses, torch.float32, used.t())
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    for r in (0, 2, 3):
        want = _attention64(q[r:r + 1], *_keys(k, v, rows_use[r]))
        _close(out[r:r + 1], lse[r:r + 1], want)


def test_merge_partials_all_empty_never_gives_nan():
    for dtype in (torch.float32, torch.bfloat16):
        out, lse = merge_partials(torch.randn(3, 5, 2, 4), torch.full((3, 5, 2), float("-inf")), dtype)
        assert out.dtype == dtype and (out == 0).all() and torch.isneginf(lse).all()


def test_merges_are_stable_for_large_scores():
    """Scores in the thousands (exp overflows fp32 beyond 88): both merges stay finite and match attention
    over all keys as closely as fp32 log-sum-exps allow (near 4500 their spacing is 4.9e-4, which
    exp(lse_i - lse) carries into the output)."""
    q, k, v, parts = _case(n=4, h=2, d=8, cuts=(0, 8, 16), magnitude=40.0)
    want = _attention64(q, k, v)
    (a, la), (b, lb) = parts
    out, lse = a.clone(), la.clone()
    merge_into(out, lse, b, lb)
    stacked = merge_partials(torch.stack([a, b]), torch.stack([la, lb]), torch.float32)
    for o, l in ((out, lse), stacked):
        assert torch.isfinite(o).all()
        torch.testing.assert_close(o.double(), want[0], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(l.double(), want[1], atol=2e-3, rtol=1e-6)


def test_merge_stacked_with_a_broadcast_valid_mask():
    """The torch reference itself: valid [P, R, 1] broadcast over the heads, out in fp32 from bf16 partials."""
    q, k, v, parts = _case(n=3)
    outs, lses = torch.stack([o for o, _ in parts]).bfloat16(), torch.stack([l for _, l in parts])
    valid = torch.tensor([True, True, False, True])[:, None, None].expand(4, 3, 1).clone()
    lses[2] = float("nan")
    out, lse = merge_stacked(outs, lses, valid)
    _close(out.bfloat16(), lse, _attention64(q, *_keys(k, v, [0, 1, 3])), torch.bfloat16)
    assert out.dtype == torch.float32


# ---------------------------------------------------------------- the Triton kernels, interpreted on CPU

INDEPENDENT_CHECKS = (   # test_merge_into_a_bf16_output_rounds_once left out: the interpreter rounds to bf16 otherwise
    test_merge_into_equals_attention_over_all_keys, test_merge_into_rows_of_an_accumulator_with_transposed_lses,
    test_merge_into_with_empty_sides_never_gives_nan, test_merge_partials_equals_attention_over_all_keys,
    test_merge_partials_never_reads_unused_partials, test_merge_partials_with_a_used_count_per_row,
    test_merge_partials_all_empty_never_gives_nan, test_merges_are_stable_for_large_scores)


def _triton_interpreted_checks():
    """The checks above with merge_into and merge_partials running the Triton kernels (Triton's interpreter
    on the CPU: TRITON_INTERPRET=1 before triton's first import, so test_merge_triton_kernels_interpreted
    runs this in a fresh process), then each kernel against the torch ops on the same inputs."""
    import warnings
    warnings.simplefilter("ignore", RuntimeWarning)          # numpy: exp/log of -inf in masked lanes
    kern = merge._build()
    assert type(kern["merge_into"]).__name__ == "InterpretedFunction", type(kern["merge_into"])
    merge._triton.kernels = lambda device: kern
    for check in INDEPENDENT_CHECKS:
        check()
    assert merge._triton.enabled, "a kernel failed and the torch ops served"
    _kernels_match_torch(kern)


def _kernels_match_torch(kern):
    """Garbage inputs, strided views, -inf on one side or both: the kernels give the torch ops' numbers."""
    n, h, d = 9, 5, 16
    for dtype in (torch.float32, torch.bfloat16):
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        acc, acc_lse = (torch.randn(n, h, d) * 3).to(dtype), (torch.randn(h, n) * 4).t()
        blk, blk_lse = (torch.randn(n - 3, h, d) * 3).to(dtype), (torch.randn(h, n - 3) * 4).t()
        acc_lse[4, 1] = blk_lse[1, 1] = float("-inf")
        acc_lse[5, 2] = blk_lse[2, 2] = float("-inf")
        want, want_lse = acc.clone(), acc_lse.clone()
        merge._merge_into_torch(want[3:], want_lse[3:], blk, blk_lse)
        merge._merge_into_triton(kern["merge_into"], acc[3:], acc_lse[3:], blk, blk_lse)
        torch.testing.assert_close(acc, want, **tol)
        torch.testing.assert_close(acc_lse, want_lse, atol=1e-5, rtol=1e-6)
        assert torch.equal(acc[:3], want[:3]) and (acc[5, 2] == 0).all()

        # D = 12 (masked lanes), lses [P, R, H] permuted from [H, R, P]; used per partial [P] and per row [P, R]
        per_row = torch.tensor([[1, 0, 2, 2, 0, 1], [3, 0, 0, 1, 1, 1], [0, 0, 4, 1, 1, 0]], dtype=torch.int32)
        for used in (torch.tensor([1, 0, 3], dtype=torch.int32), per_row, None):
            outs, lses = torch.randn(3, 6, h, 12) * 3, (torch.randn(h, 6, 3) * 4).permute(2, 1, 0)
            lses[0, 1] = float("-inf")
            if used is not None:
                unused = merge._used_mask(used, 2).expand(3, 6) == 0
                outs[unused], lses[unused] = float("nan"), float("inf")
            o, l = merge._merge_partials_triton(kern["merge_partials"], outs, lses, dtype, used)
            t_o, t_l = merge_stacked(outs, lses, None if used is None else merge._used_mask(used, 3))
            torch.testing.assert_close(o.float(), t_o.to(dtype).float(), **tol)
            torch.testing.assert_close(l, t_l, atol=1e-5, rtol=1e-5)


def test_merge_triton_kernels_interpreted():
    run_interpreted("test_merge")

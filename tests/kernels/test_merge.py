"""The fp32 LSE merge: partials over key blocks combine to attention over all keys; empty blocks are harmless."""
import torch

from kernels.attention import reference_attention
from kernels.merge import merge_into, merge_stacked


def _split_attention(q, k, v, cuts):
    return [reference_attention(q, k[a:b], v[a:b], False, 0.25) for a, b in zip(cuts[:-1], cuts[1:])]


def test_merge_into_equals_full_attention():
    q, k, v = torch.randn(9, 4, 16), torch.randn(30, 2, 16), torch.randn(30, 2, 16)
    ref_out, ref_lse = reference_attention(q, k, v, False, 0.25)
    parts = _split_attention(q, k, v, [0, 7, 7, 19, 30])      # includes an empty block
    out = torch.zeros(9, 4, 16)
    lse = torch.full((9, 4), float("-inf"))
    for o, l in parts:
        merge_into(out, lse, o, l)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-5)


def test_merge_stacked_equals_full_attention():
    q, k, v = torch.randn(3, 4, 8), torch.randn(20, 4, 8), torch.randn(20, 4, 8)
    ref_out, ref_lse = reference_attention(q, k, v, False, 0.25)
    parts = _split_attention(q, k, v, [0, 0, 11, 20])
    out, lse = merge_stacked(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-5)


def test_empty_partials_never_give_nan():
    out = torch.zeros(5, 2, 4)
    lse = torch.full((5, 2), float("-inf"))
    merge_into(out, lse, torch.zeros(5, 2, 4), torch.full((5, 2), float("-inf")))
    assert torch.isfinite(out).all() and (out == 0).all() and torch.isneginf(lse).all()
    stacked_out, stacked_lse = merge_stacked(torch.randn(3, 5, 2, 4), torch.full((3, 5, 2), float("-inf")))
    assert (stacked_out == 0).all() and torch.isneginf(stacked_lse).all()


def test_merge_is_stable_for_large_scores():
    q, k, v = torch.randn(4, 2, 8) * 40, torch.randn(16, 2, 8) * 40, torch.randn(16, 2, 8)
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), False, 1.0)
    (o1, l1), (o2, l2) = reference_attention(q, k[:8], v[:8], False, 1.0), reference_attention(q, k[8:], v[8:], False, 1.0)
    out, lse = o1.float(), l1.clone()
    merge_into(out, lse, o2, l2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=1e-4)

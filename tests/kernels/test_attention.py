"""The CPU's dense attention backend (PyTorch's CPU flash kernel) against softmax written out, and the
backend `auto` picks on CPU."""
import random

import pytest
import torch

from burstserve.kernels import attention
from burstserve.kernels.attention import AttentionBackend, _flash_aten, available_backends, select_backend


def softmax_attention(q, k, v, causal, scale):
    """fp32 scores and softmax in full: out [Sq, H, D], lse [Sq, H]; query head j reads K/V head j // group."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale                    # [H, Sq, Sk]
    if causal:
        scores.masked_fill_(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out, torch.logsumexp(scores, dim=-1).transpose(0, 1)


@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_flash_matches_softmax(h, hkv, causal):
    sq = random.randrange(1, 300)
    sk = sq if causal else random.randrange(1, 300)          # the engine's causal blocks are square
    d = random.choice([16, 32, 64])
    q, k, v = torch.randn(sq, h, d), torch.randn(sk, hkv, d), torch.randn(sk, hkv, d)
    scale = d ** -0.5
    out, lse = AttentionBackend("flash", _flash_aten)(q, k, v, causal, scale)
    ref_out, ref_lse = softmax_attention(q, k, v, causal, scale)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_cpu_flash_bf16_within_bf16_rounding():
    q, k, v = (torch.randn(200, 8, 64, dtype=torch.bfloat16), torch.randn(200, 2, 64, dtype=torch.bfloat16),
               torch.randn(200, 2, 64, dtype=torch.bfloat16))
    out, lse = AttentionBackend("flash", _flash_aten)(q, k, v, True, 0.125)
    ref_out, ref_lse = softmax_attention(q, k, v, True, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-2)


def test_auto_on_cpu_picks_the_flash_kernel():
    assert available_backends(torch.device("cpu")) == ["flash", "reference"]
    assert select_backend(torch.device("cpu"), torch.float32, 8, 2, 32).name == "flash"


def _fake_flash_attn_4(monkeypatch, private):
    """flash_attn.cute as modules whose functions record their calls (flash-attn-4 is not on CPU machines)."""
    import sys
    import types
    calls = []
    cute, interface = types.ModuleType("flash_attn.cute"), types.ModuleType("flash_attn.cute.interface")
    cute.flash_attn_func = lambda *a, **kw: calls.append(("public dense", kw)) or ("out", "lse")
    cute.flash_attn_varlen_func = lambda *a, **kw: calls.append(("public varlen", kw)) or ("out", "lse")
    interface._flash_attn_fwd = private(calls)
    cute.interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    monkeypatch.setattr(attention, "_FA4_DIRECT", [True])
    return calls


def test_fa4_forward_calls_the_private_forward_and_returns_out_and_lse(monkeypatch):
    calls = _fake_flash_attn_4(monkeypatch, lambda calls: lambda *a, **kw: calls.append(("private", kw))
                               or ("out", "lse", None, None, None))
    assert attention.fa4_forward(1, 2, 3, softmax_scale=0.5, causal=True) == ("out", "lse")
    assert calls == [("private", {"return_lse": True, "softmax_scale": 0.5, "causal": True})]


def test_fa4_forward_falls_back_to_the_public_functions_for_good(monkeypatch):
    def private(calls):
        def refuse(*a, page_table=None, **kw):
            calls.append(("private", kw))
            raise TypeError("unexpected keyword argument")
        return refuse
    calls = _fake_flash_attn_4(monkeypatch, private)
    assert attention.fa4_forward(1, 2, 3, cu_seqlens_q=4, page_table=5, causal=False) == ("out", "lse")
    assert attention.fa4_forward(1, 2, 3, softmax_scale=0.5, causal=True) == ("out", "lse")
    assert [c[0] for c in calls] == ["private", "public varlen", "public dense"]
    assert calls[1][1] == {"return_lse": True, "cu_seqlens_q": 4, "page_table": 5, "causal": False}


def test_the_probe_refuses_a_backend_that_returns_nan_or_rounds_fp32_to_tf32():
    """select_backend's probe: cuDNN's SDPA returned NaN for fp32 inputs on an H100 (2026-12-07) and passed a
    probe that compared `error > tolerance` (False for NaN), so an fp32 engine on a GPU attended through it.
    A NaN disagrees; fp32 needs fp32's accuracy (an error of TF32's size is refused); the reference's own
    results, and an fp32 kernel's, pass."""
    from burstserve.kernels.attention import AttentionBackend, _probe, reference_attention

    def nan(q, k, v, causal, scale):
        out, lse = reference_attention(q, k, v, causal, scale)
        return torch.full_like(out, float("nan")), lse

    def tf32(q, k, v, causal, scale):
        out, lse = reference_attention(q, k, v, causal, scale)
        return out * (1 + 2e-3), lse

    cpu = torch.device("cpu")
    assert not _probe(AttentionBackend("nan", nan), cpu, torch.float32, 4, 2, 32)
    assert not _probe(AttentionBackend("tf32", tf32), cpu, torch.float32, 4, 2, 32)
    assert _probe(AttentionBackend("tf32", tf32), cpu, torch.bfloat16, 4, 2, 32)      # within bf16's rounding
    assert _probe(AttentionBackend("reference", reference_attention), cpu, torch.float32, 4, 2, 32)

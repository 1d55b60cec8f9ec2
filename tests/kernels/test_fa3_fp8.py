"""kernels/fa3_fp8.py (`--attention-backend fa3-fp8`): FlashAttention-3's FP8 arithmetic, its torch path
against a reference written apart (float64, dense) that rounds the same way; the key segments and their merge
against exact attention; the casts in row blocks; the refusals. On GPUs the kernel itself is
checked against the torch path (tests/gpu, scripts/gpu_fa3_fp8.py agree)."""
import random

import pytest
import torch

from burstserve.kernels import fa3_fp8
from burstserve.kernels.attention import backend_refusal, select_backend
from burstserve.kernels.fa3_fp8 import fa3_fp8_attention, fa3_fp8_refusal, run_segments, segments
from hf_reference import fa3_like_reference


def _qkv(sq, sk, h=8, hkv=2, d=64, dtype=torch.float32):
    return (torch.randn(sq, h, d, dtype=dtype), torch.randn(sk, hkv, d, dtype=dtype),
            torch.randn(sk, hkv, d, dtype=dtype))


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("sq,sk,causal", [(300, 300, True), (64, 500, True), (128, 400, False), (1, 900, True)])
def test_torch_path_rounds_as_the_reference_and_fp8_costs_what_it_should(sq, sk, causal):
    q, k, v = _qkv(sq, sk)
    scale = 64 ** -0.5
    out, lse = fa3_fp8_attention(q, k, v, causal, scale, kernel="torch")
    want, want_lse = fa3_like_reference(q, k, v, causal, scale)
    assert _rel(out, want) < 5e-3, _rel(out, want)             # bf16 output, fp32 against fp64 sums
    assert (lse.double() - want_lse).abs().max() < 1e-5        # the same e4m3 roundings; fp32 sums against fp64
    # against attention without rounding: FP8's error (3 mantissa bits), not none and not more
    assert 1e-2 < _rel(out, _exact(q, k, v, causal, scale)) < 0.1


@pytest.mark.parametrize("trial", range(40))
def test_segments_cover_every_visible_key_once(trial):
    rng = random.Random(trial)
    sq = rng.randrange(1, 60)
    sk = rng.randrange(1, 90) + (sq if rng.random() < 0.7 else 0)
    causal, segment = rng.random() < 0.7, rng.randrange(1, 200)
    count = torch.zeros(sq, sk, dtype=torch.int32)
    pieces = list(segments(sq, sk, causal, segment))
    for q0, q1, k0, k1, masked in pieces:
        assert 0 <= q0 < q1 <= sq and 0 <= k0 < k1 <= sk, (q0, q1, k0, k1)
        assert k1 - k0 <= segment or len(pieces) == 1, (q0, q1, k0, k1, segment)
        block = torch.ones(q1 - q0, k1 - k0, dtype=torch.int32)
        if masked:           # a masked call is a square, or ends the keys and the rows (end-aligned)
            assert q1 - q0 == k1 - k0 or (q1, k1) == (sq, sk), (q0, q1, k0, k1)
            rows = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
            block = (torch.arange(k1 - k0)[None, :] <= rows).int()
        count[q0:q1, k0:k1] += block
    visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq) if causal else torch.ones(sq, sk)
    assert torch.equal(count, visible.int()), (sq, sk, causal, segment)


@pytest.mark.parametrize("sq,sk,causal,segment", [(200, 200, True, 48), (50, 333, True, 64), (70, 250, False, 100),
                                                 (120, 300, True, 50)])
def test_segments_merged_by_lse_equal_one_exact_call(sq, sk, causal, segment):
    """With an exact kernel in place of the FP8 one, the segmented call equals attention in one piece."""
    q, k, v = _qkv(sq, sk)
    scale = 0.1

    def exact(qs, ks, vs, masked):                           # end-aligned causal, as FA3's
        g = qs.shape[1] // ks.shape[1]
        mask = (torch.arange(ks.shape[0])[None, :] <= torch.arange(qs.shape[0])[:, None] + ks.shape[0] - qs.shape[0]
                if masked else None)
        qh, kh, vh = qs.transpose(0, 1), ks.repeat_interleave(g, 1).transpose(0, 1), vs.repeat_interleave(g, 1).transpose(0, 1)
        s = torch.einsum("hqd,hkd->hqk", qh, kh) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.einsum("hqk,hkd->qhd", torch.softmax(s, -1), vh), torch.logsumexp(s, -1).T

    out, lse = run_segments(exact, q, k, v, causal, segment)
    want, want_lse = exact(q, k, v, causal)
    assert len(list(segments(sq, sk, causal, segment))) > 2
    assert (out - want).abs().max() < 1e-5 and (lse - want_lse).abs().max() < 1e-5


def _exact(q, k, v, causal, scale):
    g = q.shape[1] // k.shape[1]
    sq, sk = q.shape[0], k.shape[0]
    visible = (torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)) if causal else None
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).double(), k.repeat_interleave(g, 1).transpose(0, 1).double(),
        v.repeat_interleave(g, 1).transpose(0, 1).double(), attn_mask=visible, scale=scale).transpose(0, 1)


def test_a_long_call_in_segments_has_the_error_of_one_call():
    """Segments round P against each segment's own maximum: other roundings, the same size of error."""
    q, k, v = _qkv(64, 2048)
    exact = _exact(q, k, v, True, 0.125)
    one, _ = fa3_fp8_attention(q, k, v, True, 0.125, segment=1 << 20, kernel="torch")
    cut, _ = fa3_fp8_attention(q, k, v, True, 0.125, segment=256, kernel="torch")
    assert _rel(cut, one) > 1e-3                                   # the segments did run
    assert _rel(cut, exact) < 1.25 * _rel(one, exact), (_rel(cut, exact), _rel(one, exact))


def test_the_backend_is_chosen_only_when_asked_and_refused_where_it_cannot_run(monkeypatch):
    cpu = torch.device("cpu")
    assert backend_refusal("fa3-fp8", ["cpu"]) is None and fa3_fp8_refusal(cpu) is None
    backend = select_backend(cpu, torch.float32, 8, 2, 64, "fa3_fp8")
    assert backend.name == "fa3_fp8" and backend.fp8
    q, k, v = _qkv(40, 40)                                               # on CPU every call is FP8
    assert torch.equal(backend(q, k, v, True, 0.125)[0], fa3_fp8_attention(q, k, v, True, 0.125)[0])
    assert not select_backend(cpu, torch.float32, 8, 2, 64).fp8          # auto never picks FP8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "needs a Hopper GPU" in fa3_fp8_refusal(torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def missing():
        raise ImportError("No module named 'fa3_fwd_interface'")
    monkeypatch.setattr(fa3_fp8, "_fa3_module", missing)
    message = fa3_fp8_refusal(torch.device("cuda:0"))
    assert "fa3-fwd" in message and "fa3_fwd_interface" in message
    assert "fa3-fwd" in backend_refusal("fa3-fp8", ["cuda:0"])


def test_the_casts_in_row_blocks_equal_one_cast(monkeypatch):
    x = torch.randn(1000, 8, 64) * torch.rand(1000, 1, 1) * 10
    whole = fa3_fp8.to_e4m3(x, 2)
    monkeypatch.setattr(fa3_fp8, "CAST_ROWS", 96)
    blocks = fa3_fp8.to_e4m3(x, 2)
    assert torch.equal(whole[1], blocks[1]) and torch.equal(whole[0].float(), blocks[0].float())
    want = x.reshape(1000, 2, -1).abs().amax(dim=(0, 2)) / 448
    assert torch.allclose(whole[1], want) and whole[0].float().abs().max() == 448


@pytest.mark.parametrize("d", [64, 128])
def test_the_rotation_is_a_signed_hadamard_matrix_the_same_on_every_call(d):
    """R = diag(signs) H: H_ij = (-1)^popcount(i & j) (Sylvester's order, built here apart), so R R^T = D I
    exactly and q R . k R = D q . k; one fixed set of signs, whatever the dtype or the call."""
    r = fa3_fp8.rotation(d, torch.float32, torch.device("cpu"))
    h = 1 - 2 * torch.tensor([[bin(i & j).count("1") % 2 for j in range(d)] for i in range(d)], dtype=torch.float32)
    signs = r[:, 0] / h[:, 0]
    assert set(signs.tolist()) == {-1.0, 1.0} and torch.equal(r, signs[:, None] * h)
    assert torch.equal(r @ r.T, d * torch.eye(d))
    assert torch.equal(fa3_fp8.rotation(d, torch.bfloat16, torch.device("cpu")).float(), r)
    assert 0.25 * d < (signs > 0).sum() < 0.75 * d                  # signs drawn, not all alike
    assert fa3_fp8.rotation(96, torch.float32, torch.device("cpu")) is None


def test_the_rotation_spreads_the_channels_that_carry_q_dot_k(monkeypatch):
    """A trained model's q . k is carried by a few channels (large in q and k alike). Under one scale a KV head
    their elements round like any other; turned, every channel carries a share and the errors average out:
    FA3's arithmetic with the rotation has under 0.6x the error against exact attention it has without it
    (0.35-0.46x over three draws)."""
    q, k, v = _qkv(256, 256)
    for x in (q, k):
        x[..., :3] *= 12.0                                                # three dominant channels
    exact = _exact(q, k, v, True, 0.125 / 12)
    turned, _ = fa3_fp8_attention(q, k, v, True, 0.125 / 12, kernel="torch")
    monkeypatch.setattr(fa3_fp8, "rotation", lambda *a: None)
    plain, _ = fa3_fp8_attention(q, k, v, True, 0.125 / 12, kernel="torch")
    assert _rel(turned, exact) < 0.6 * _rel(plain, exact), (_rel(turned, exact), _rel(plain, exact))

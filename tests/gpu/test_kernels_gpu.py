"""GPU checks of kernels/ (one GPU): the flash-attn-4 backend against cuDNN and the fp32 reference;
paged_attention on CUDA (flash-attn-4 path with and without the split, the dense fallback; the decode
fast path, max_seqlen_q=1, with the split's Triton kernels and with their torch fallback) against the
CPU reference on the CPU tests' cases, and captured + replayed in a CUDA graph on the flash-attn-4 path.
Run: `python -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py` (bash scripts/gpu.sh kernels)."""
import os
import random
import sys

import pytest
import torch

from burstserve.kernels.attention import AttentionBackend, _GPU_BACKENDS, available_backends, reference_attention
import burstserve.kernels.paged_attention as pa
from burstserve.kernels import merge
from burstserve.kernels.paged_attention import fa4_available, paged_attention
from burstserve.kernels.fa3_fp8 import fa3_fp8_attention, fa3_fp8_refusal

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
import test_paged_attention as cpu_cases  # noqa: E402  (make_case, dense_reference)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda:0")
needs_fa4 = pytest.mark.skipif(not torch.cuda.is_available() or not fa4_available(DEV),
                               reason="needs flash-attn-4 on SM90+")


@needs_fa4
def test_auto_prefers_flash_attn_4_then_cudnn():
    names = available_backends(DEV)
    assert names[:2] == ["flash_attn_4", "cudnn"], names
    from burstserve.kernels.attention import select_backend
    assert select_backend(DEV, torch.bfloat16, 32, 8, 128).name == "flash_attn_4"


@needs_fa4
@pytest.mark.parametrize("sq,sk,h,hkv,causal", [
    (1000, 1000, 32, 8, True), (4099, 4099, 32, 8, True), (2048, 2048, 16, 16, True),
    (777, 3001, 32, 8, False), (1, 5000, 32, 8, False), (4096, 4096, 8, 1, False)])
def test_flash_attn_4_matches_cudnn_and_reference(sq, sk, h, hkv, causal):
    q = torch.randn(sq, h, 128, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(sk, 2, hkv, 128, device=DEV, dtype=torch.bfloat16)     # K/V as views, as the ring passes them
    args = (q, kv[:, 0], kv[:, 1], causal, 128 ** -0.5)
    out, lse = AttentionBackend("flash_attn_4", _GPU_BACKENDS["flash_attn_4"])(*args)
    c_out, c_lse = AttentionBackend("cudnn", _GPU_BACKENDS["cudnn"])(*args)
    r_out, r_lse = reference_attention(*args)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (sq, h) and lse.dtype == torch.float32
    assert (out.float() - r_out.float()).abs().max() < 2e-2
    assert (lse - r_lse).abs().max() < 1e-3
    assert (out.float() - c_out.float()).abs().max() < 2e-2
    assert (lse - c_lse).abs().max() < 1e-3


def _gpu_case(q_lens, k_lens, bs, h=8, hkv=2, d=128):
    return cpu_cases.make_case(q_lens, k_lens, h, hkv, d, bs, dtype=torch.bfloat16, device=DEV)


def _check(case, causal, **kw):
    out, lse = paged_attention(*case, 128 ** -0.5, causal=causal, **kw)
    ref_out, ref_lse = cpu_cases.dense_reference(*[t.cpu() for t in case], 128 ** -0.5, causal)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (out.float().cpu() - ref_out).abs().max() < 2e-2
    assert (lse.cpu()[fin] - ref_lse[fin]).abs().max() < 2e-3


CASES = {   # name: (q_lens, k_lens)
    "decode-mixed": ([1] * 8, [1, 127, 128, 129, 300, 1000, 2500, 17]),
    "chunks": ([1, 7, 33, 130, 2], [5, 7, 200, 333, 40]),
    "no-keys": ([3, 0, 1, 2, 4], [0, 9, 40, 0, 70]),
    "one-long": ([1], [20000]),
}


@needs_fa4
@pytest.mark.parametrize("bs", [1, 16, 128])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_chunks", [None, 1, 5])
def test_paged_fa4_matches_cpu_reference(bs, case, num_chunks):
    if bs == 1 and case == "one-long":
        pytest.skip("20000 one-slot pages: covered at 16 and 128")
    q_lens, k_lens = CASES[case]
    for causal in (True, False):
        _check(_gpu_case(q_lens, k_lens, bs), causal, backend="fa4", num_chunks=num_chunks)


@pytest.mark.parametrize("bs", [1, 16, 128])
@pytest.mark.parametrize("case", ["decode-mixed", "chunks", "no-keys"])
def test_paged_dense_fallback_matches_cpu_reference(bs, case):
    q_lens, k_lens = CASES[case]
    for causal in (True, False):
        _check(_gpu_case(q_lens, k_lens, bs), causal, backend="dense")


@needs_fa4
@pytest.mark.parametrize("q_lens,k_lens,num_chunks", [
    ([1] * 4, [9000, 1, 300, 4096], None),      # decode, split chosen from the shapes
    ([1, 3, 5], [2000, 40, 700], 1),             # chunks, no split (bottom-right causal in the kernel)
    ([1, 3, 5], [2000, 40, 700], 4)])            # chunks through the split
def test_paged_fa4_in_cuda_graph(q_lens, k_lens, num_chunks):
    """Capture once; then write new q values and new lengths into the same tensors and replay."""
    q, kc, vc, table, cu, lens = _gpu_case(q_lens, k_lens, 128)
    run = lambda: paged_attention(q, kc, vc, table, cu, lens, 128 ** -0.5, True, backend="fa4",  # noqa: E731
                                  num_chunks=num_chunks)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            run()                                   # compiles, allocates outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = run()
    for step in range(3):
        q.copy_(torch.randn_like(q))
        new_lens = [max(ql, n - random.randint(0, 64)) for ql, n in zip(q_lens, k_lens)]   # fits the table
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = cpu_cases.dense_reference(*[t.cpu() for t in (q, kc, vc, table, cu, lens)],
                                                     128 ** -0.5, True)
        assert (out.float().cpu() - ref_out).abs().max() < 2e-2, step
        assert (lse.cpu() - ref_lse).abs().max() < 2e-3, step


# ---------------------------------------------------------------- decode fast path (max_seqlen_q=1)

DECODE_CASES = {   # name: k_lens, one new token each; 0: a padding slot of a CUDA-graph batch
    "decode-mixed": [1, 127, 128, 129, 300, 1000, 2500, 17],
    "decode-padded": [0, 5000, 0, 300],
    "one-long": [20000],
}


def _split_impl(monkeypatch, impl):
    """impl "triton": the split's Triton kernels, its prep and kernels/merge.py's merge (and check they
    stayed on: _split_triton_on); "torch": the fallback."""
    if impl == "torch":
        monkeypatch.setattr(pa._triton, "enabled", False)
        monkeypatch.setattr(merge._triton, "enabled", False)
    else:
        assert pa._triton.kernels(DEV) is not None and merge._triton.kernels(DEV) is not None, \
            "Triton split kernels unavailable"


def _split_triton_on() -> bool:
    """False once a split kernel failed (logged) and the torch ops took over."""
    return pa._triton.enabled and merge._triton.enabled


DECODE_PARAMS = ([("triton", bs, case, n) for bs in (16, 128) for case in DECODE_CASES for n in (None, 1, 5)]
                 + [("torch", 128, case, n) for case in DECODE_CASES for n in (None, 5)])


@needs_fa4
@pytest.mark.parametrize("impl,bs,case,num_chunks", DECODE_PARAMS)
def test_paged_fa4_decode_keyword_matches_cpu_reference(monkeypatch, impl, bs, case, num_chunks):
    _split_impl(monkeypatch, impl)
    k_lens = DECODE_CASES[case]
    for causal in (True, False):
        _check(_gpu_case([1] * len(k_lens), k_lens, bs), causal, backend="fa4", num_chunks=num_chunks, max_seqlen_q=1)
    assert impl == "torch" or _split_triton_on(), "a Triton kernel failed and fell back to torch (see the log)"


def test_paged_dense_fallback_takes_max_seqlen_q():
    k_lens = DECODE_CASES["decode-padded"]
    _check(_gpu_case([1] * len(k_lens), k_lens, 16), True, backend="dense", max_seqlen_q=1)


@needs_fa4
@pytest.mark.parametrize("impl,k_lens,num_chunks", [
    ("triton", [9000, 1, 300, 4096, 0], None),     # split chosen from the shapes (13 chunks), a padding slot
    ("triton", [20000], None),                     # one long sequence: 39 chunks, q as a stride-0 view
    ("triton", [20000], 16),
    ("triton", [3000, 0, 700], 1),                 # no split
    ("torch", [9000, 1, 300, 4096, 0], None),      # the split's torch fallback
    ("torch", [20000], None)])
def test_paged_fa4_decode_in_cuda_graph(monkeypatch, impl, k_lens, num_chunks):
    """The decode fast path captured once (shape constants cached by the eager warm-up); then new q
    values and new lengths (some 0, some back from 0) written into the same tensors and replayed."""
    _split_impl(monkeypatch, impl)
    q, kc, vc, table, cu, lens = _gpu_case([1] * len(k_lens), k_lens, 128)
    cap = table.shape[1] * 128
    run = lambda: paged_attention(q, kc, vc, table, cu, lens, 128 ** -0.5, True, backend="fa4",  # noqa: E731
                                  num_chunks=num_chunks, max_seqlen_q=1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = run()
    for step in range(4):
        q.copy_(torch.randn_like(q))
        new_lens = [0 if (step + b) % 3 == 0 and len(k_lens) > 1 else random.randint(1, cap)
                    for b in range(len(k_lens))]
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = cpu_cases.dense_reference(*[t.cpu() for t in (q, kc, vc, table, cu, lens)],
                                                     128 ** -0.5, True)
        assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse)), step
        fin = torch.isfinite(ref_lse)
        assert (out.float().cpu() - ref_out).abs().max() < 2e-2, step
        assert (lse.cpu()[fin] - ref_lse[fin]).abs().max() < 2e-3, step
    assert impl == "torch" or _split_triton_on(), "a Triton kernel failed and fell back to torch (see the log)"


@needs_fa4
@pytest.mark.parametrize("num_chunks", [1, 32])
def test_paged_fa4_reads_a_cache_over_2_31_elements(num_chunks):
    """A layer cache of 4.6e9 elements (140000 pages of 128 x 2 x 128), the sequence's pages at its
    end: flash-attn-4 addresses it in 64 bits (the engine does not cap its pool at 2^31 elements)."""
    total, ctx = 140000, 16384
    kc = torch.empty(total, 128, 2, 128, device=DEV, dtype=torch.bfloat16).normal_()
    vc = torch.empty_like(kc).normal_()
    table = torch.arange(total - ctx // 128, total, device=DEV, dtype=torch.int32)[None]
    q = torch.randn(1, 8, 128, device=DEV, dtype=torch.bfloat16)
    cu = torch.arange(2, device=DEV, dtype=torch.int32)
    lens = torch.tensor([ctx], device=DEV, dtype=torch.int32)
    ref, ref_lse = paged_attention(q, kc, vc, table, cu, lens, 128 ** -0.5, False, backend="reference")
    out, lse = paged_attention(q, kc, vc, table, cu, lens, 128 ** -0.5, False, backend="fa4",
                               num_chunks=num_chunks, max_seqlen_q=1)
    assert (out.float() - ref.float()).abs().max() < 2e-2 and (lse - ref_lse).abs().max() < 1e-3


@needs_fa4
def test_paged_fa4_keyless_rows_with_a_table_at_a_segment_start():
    """Every row without keys (a CUDA graph's padding batch) and the block table alone at the start
    of its own cudaMalloc segment: flash-attn-4 reads the int32 before a keyless row's table row,
    which guarded_table keeps inside memory (an illegal memory access before it, 2026-11-23)."""
    kc = torch.randn(64, 128, 2, 128, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(4, 8, 128, device=DEV, dtype=torch.bfloat16)
    cu = torch.arange(5, device=DEV, dtype=torch.int32)
    lens = torch.zeros(4, device=DEV, dtype=torch.int32)
    for num_chunks in (1, 8):
        torch.cuda.empty_cache()
        big = torch.zeros(1 << 26, device=DEV, dtype=torch.int32)   # 256 MiB: a segment of its own
        table = big[:4 * 128].view(4, 128)
        out, lse = paged_attention(q, kc, vc, table, cu, lens, 128 ** -0.5, False, backend="fa4",
                                   num_chunks=num_chunks, max_seqlen_q=1)
        torch.cuda.synchronize()
        assert (out == 0).all() and torch.isneginf(lse).all()
        del big, table


@pytest.mark.parametrize("s", [1, 64, 3000])
def test_fused_kernels_match_torch_ops_on_cuda(s):
    """burstserve.kernels.fused's Triton kernels (llama3-8b shapes, bf16) against the torch ops they replace:
    the same bits for the KV store and the residual; rope, silu*up within one bf16 rounding and the
    norm within two (Triton's and torch's fp32 code differ in summation order and contraction)."""

    def ulps(a, b, n):   # |a - b| <= n bf16 roundings of b
        return ((a.float() - b.float()).abs() <= b.float().abs() * n * 2 ** -8 + 1e-6).all()
    from burstserve.kernels import fused
    kern = fused._triton.kernels(DEV)
    assert kern is not None, "Triton kernels did not build"
    bf = torch.bfloat16
    h, hkv, d, hid, inter = 32, 8, 128, 4096, 14336
    x, r, w = torch.randn(s, hid, device=DEV, dtype=bf), torch.randn(s, hid, device=DEV, dtype=bf), \
        torch.randn(hid, device=DEV, dtype=bf)
    out, res = fused._rms_norm_triton(kern["rms_norm"], x, w, 1e-5, r)
    assert torch.equal(res, x + r)
    ref = fused._rms_norm_torch(x + r, w, 1e-5)
    assert ulps(out, ref, 4)
    qkv = torch.randn(s, (h + 2 * hkv) * d, device=DEV, dtype=bf)
    pos = torch.randint(0, 1 << 17, (s,), device=DEV)
    freqs = pos.float()[:, None] * torch.rand(d // 2, device=DEV)[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos().to(bf), torch.cat([freqs, freqs], -1).sin().to(bf)
    ref = qkv.clone()
    rot = ref[:, :(h + hkv) * d].view(s, h + hkv, d)
    rot.copy_(fused._rope_torch(rot, cos[:, None], sin[:, None]))
    fused._rope_triton(kern["rope"], qkv, cos, sin, h, hkv)
    assert ((qkv.float() - ref.float()).abs() <= 2 ** -7 * (qkv.float().abs() + 2)).all()   # sums of rounded products
    qw, kw = torch.randn(2, d, device=DEV, dtype=bf)          # Qwen3's q/k head norms first, the same kernel
    ref = qkv.clone()
    rot = ref[:, :(h + hkv) * d].view(s, h + hkv, d)
    fused._head_norms_torch(rot, qw, kw, 1e-6, h)
    rot.copy_(fused._rope_torch(rot, cos[:, None], sin[:, None]))
    fused._rope_triton(kern["rope"], qkv, cos, sin, h, hkv, (qw, kw, 1e-6))
    assert ((qkv.float() - ref.float()).abs() <= 2 ** -6 * (qkv.float().abs() + 2)).all()   # and the norm's roundings
    gate_up = torch.randn(s, 2 * inter, device=DEV, dtype=bf)
    assert ulps(fused._silu_and_mul_triton(kern["silu_and_mul"], gate_up),
                torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:], 2)
    kc, vc = torch.randn(2, 5000, 128, hkv, d, device=DEV, dtype=bf)
    ref_k, ref_v = kc.clone(), vc.clone()
    kv = qkv.view(s, h + 2 * hkv, d)
    k, v = kv[:, h:h + hkv], kv[:, h + hkv:]
    slots = torch.randperm(5000 * 128, device=DEV)[:s]
    ref_k.view(-1, hkv, d).index_copy_(0, slots, k)
    ref_v.view(-1, hkv, d).index_copy_(0, slots, v)
    fused._store_kv_triton(kern["store_kv"], kc, vc, slots, k, v)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.parametrize("acc_dtype", [torch.bfloat16, torch.float32])
def test_ring_merge_on_cuda_matches_the_torch_merge(acc_dtype):
    """burstserve.kernels.merge.merge_into's kernel (BurstAttention's merge of a block into its accumulator, in place):
    rows m: of an accumulator, flash-attn-4's transposed LSE views, rows with no keys on one side or both,
    against its torch ops (the same fp32 arithmetic, one rounding into a bf16 out)."""
    kern = merge._triton.kernels(DEV)
    assert kern is not None, "Triton kernels did not build"
    n, m, h, d = 4096, 1500, 32, 128
    acc = (torch.randn(n, h, d, device=DEV) * 2).to(acc_dtype)
    acc_lse = (torch.randn(h, n, device=DEV) * 5).t()
    blk = (torch.randn(n - m, h, d, device=DEV) * 2).to(torch.bfloat16)
    blk_lse = (torch.randn(h, n - m, device=DEV) * 5).t()
    acc_lse[m:m + 9, 3] = float("-inf")
    blk_lse[:9, 3:5] = float("-inf")
    want, want_lse = acc.clone(), acc_lse.clone()
    merge._merge_into_torch(want[m:], want_lse[m:], blk, blk_lse)
    merge._merge_into_triton(kern["merge_into"], acc[m:], acc_lse[m:], blk, blk_lse)
    tol = dict(atol=1e-5, rtol=1e-5) if acc_dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(acc, want, **tol)
    torch.testing.assert_close(acc_lse, want_lse, atol=1e-5, rtol=1e-6)
    assert (acc[m:m + 9, 3] == 0).all() and torch.isneginf(acc_lse[m:m + 9, 3]).all()
    assert torch.equal(acc[:m], want[:m])


@pytest.mark.parametrize("workers,rows", [(2, 1), (2, 256), (3, 64), (8, 17)])
def test_merge_partials_on_cuda_matches_the_torch_merge(workers, rows):
    """The cross-worker merge (engine.decode_attention.merge_over_workers) through the split path's
    Triton merge kernel: partials as views into one gathered [G, R, H, D + 1] fp32 buffer (a keyless
    worker's partial: 0, -inf), bf16 out, against kernels.merge.merge_stacked; and inside a CUDA graph."""
    from burstserve.kernels.merge import merge_stacked
    kern = merge._triton.kernels(DEV)
    assert kern is not None, "Triton kernels did not build"
    gathered = torch.randn(workers, rows, 32, 129, device=DEV)
    gathered[1, :rows // 2, :, :128], gathered[1, :rows // 2, :, 128] = 0.0, float("-inf")
    outs, lses = gathered[..., :128], gathered[..., 128]
    o, l = merge._merge_partials_triton(kern["merge_partials"], outs, lses, torch.bfloat16)   # the kernel itself
    t_o, t_l = merge_stacked(outs, lses)
    torch.testing.assert_close(o, t_o.to(torch.bfloat16), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(l, t_l, atol=1e-5, rtol=1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_o, g_l = merge.merge_partials(outs, lses, torch.bfloat16)
    assert merge._triton.enabled, "the Triton merge failed and fell back to torch ops"
    gathered.copy_(torch.randn_like(gathered))
    graph.replay()
    t_o, t_l = merge_stacked(outs, lses)
    torch.testing.assert_close(g_o, t_o.to(torch.bfloat16), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(g_l, t_l, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens,h,hkv,splits", [([0, 1, 200, 5000], 32, 8, None), ([3000], 32, 8, 7),
                                               ([130, 129, 128, 1], 8, 8, 2), ([9000, 1, 0], 32, 4, 40)])
def test_fp8_paged_decode_kernel_matches_its_reference_and_replays_in_a_graph(lens, h, hkv, splits):
    """The Triton FP8 decode kernel (bf16 queries, pages of 128) against the torch reference over the same
    pages (fp32), eagerly and replayed from a CUDA graph after the lengths change (same shapes)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
    import test_fp8_paged_attention as fp8_cases
    from burstserve.kernels import fp8_paged_attention as fpa
    q, kp, vp, table, seq_lens, _ = fp8_cases._case(lens, h, hkv, 128, bs=128)
    q, table, seq_lens = q.to(DEV, torch.bfloat16), table.to(DEV), seq_lens.to(DEV)
    kp, vp = (type(p)(p.data.to(DEV), p.scale.to(DEV)) for p in (kp, vp))
    scale = 128 ** -0.5
    want, want_lse = fpa.fp8_paged_decode_reference(q, kp, vp, table, seq_lens, scale)
    out, lse = fpa.fp8_paged_decode(q, kp, vp, table, seq_lens, scale, splits)
    assert fpa._triton.enabled, "the Triton kernel failed and the torch ops served"
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed = fpa.fp8_paged_decode(q, kp, vp, table, seq_lens, scale, splits)
    seq_lens.copy_((seq_lens // 2).to(torch.int32))
    g.replay()
    want, want_lse = fpa.fp8_paged_decode_reference(q, kp, vp, table, seq_lens, scale)
    torch.testing.assert_close(graphed[0].float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(graphed[1], want_lse, atol=1e-3, rtol=1e-4)


@needs_fa4
@pytest.mark.parametrize("segment", [None, 1024])
def test_chunks_over_fp8_pages_run_one_flash_attn_4_call_and_match_the_reference(monkeypatch, segment):
    """A chunk over FP8 pages (no decode): the pages gathered into bf16, then one flash-attn-4 call whose
    causal mask is aligned to the end, against the reference backend over the same pages; causal chunks after
    a cached context, a chunk that is the whole sequence, a sequence without keys, not causal (pass-Q's
    call); segment 1024: contexts past FP8_GATHER_SEGMENT gathered a segment at a time and merged."""
    from burstserve.kernels import kv_quant
    if segment is not None:
        monkeypatch.setattr(pa, "FP8_GATHER_SEGMENT", segment)
    h, hkv, d, bs = 32, 8, 128, 128
    blocks = 240
    x = torch.randn(2, blocks, bs, hkv, d, device=DEV)
    x[0, ..., 5] *= 20
    pages = [kv_quant.Fp8Pages(*kv_quant.quantize_kv(x[i])) for i in range(2)]
    for q_lens, k_lens, causal in (([300], [5000], True), ([257], [257], True), ([40, 0, 7], [3000, 0, 9000], True),
                                   ([64, 64], [2000, 6000], False), ([1000], [9000], True)):
        table = torch.randperm(blocks, device=DEV)[:len(q_lens) * 71].view(len(q_lens), 71).to(torch.int32)
        cu = torch.tensor([0] + q_lens, device=DEV).cumsum(0).to(torch.int32)
        lens = torch.tensor(k_lens, dtype=torch.int32, device=DEV)
        q = torch.randn(sum(q_lens), h, d, device=DEV, dtype=torch.bfloat16)
        args = (q, *pages, table, cu, lens, d ** -0.5)
        out, lse = paged_attention(*args, causal=causal, host_sizes=(cu.tolist(), k_lens))
        want, want_lse = paged_attention(*args, causal=causal, backend="reference")
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_pages_gather_kernel_equals_the_torch_ops(dtype):
    """Fp8Pages.gather (one Triton kernel on CUDA) against dequantize_kv over the same pages: the same values
    bit for bit, pages shuffled, a partial last page, llama3-8b's 8 KV heads of 128."""
    from burstserve.kernels import kv_quant
    x = torch.randn(300, 128, 8, 128, device=DEV) * torch.exp(2 * torch.randn(300, 128, 8, 1, device=DEV))
    x[..., 9] *= 30
    data, scale = kv_quant.quantize_kv(x)
    pages = kv_quant.Fp8Pages(data, scale)
    blocks = torch.randperm(300, device=DEV)[:257]
    for n in (1, 5000, 257 * 128 - 77):
        want = kv_quant.dequantize_kv(data[blocks].flatten(0, 1)[:n], scale[blocks].flatten(0, 1)[:n], dtype)
        got = pages.gather(blocks, n, dtype)
        assert kv_quant._triton.enabled, "the Triton kernel failed and the torch ops served"
        assert torch.equal(got, want), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_kv_round_and_store_kernels_equal_the_torch_ops(dtype):
    """round_kv_ and store_kv_fp8 (one Triton kernel each) against quantize_kv/round_kv's torch ops: the
    same bytes, scales and values, bit for bit, from rows of a fused QKV output with an outlier channel.
    (fp16 rows take the torch ops: kv_quant._rows_ok.)"""
    from burstserve.kernels import kv_quant
    n, hkv, d = 1000, 8, 128
    qkv = torch.randn(n, 32 + 2 * hkv, d, device=DEV) * torch.exp(2 * torch.randn(n, 32 + 2 * hkv, 1, device=DEV))
    qkv[:, 32:32 + hkv, 9] *= 30
    qkv[5, 32:] = 0
    qkv = qkv.clamp(-6e4, 6e4).to(dtype)                                   # finite in fp16
    k, v = qkv[:, 32:32 + hkv], qkv[:, 32 + hkv:]
    want = kv_quant.round_kv(k), kv_quant.round_kv(v), kv_quant.quantize_kv(k), kv_quant.quantize_kv(v)
    pages = [torch.zeros(200, 128, hkv, d, dtype=torch.uint8, device=DEV) for _ in range(2)]
    scales = [torch.zeros(200, 128, hkv, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    slots = torch.randperm(200 * 128, device=DEV)[:n]
    kv_quant.store_kv_fp8(pages[0], scales[0], pages[1], scales[1], slots, k, v)
    kv_quant.round_kv_(k, v)
    assert kv_quant._triton.enabled, "the Triton kernel failed and the torch ops served"
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])
    for j in range(2):
        assert torch.equal(pages[j].view(-1, hkv, d)[slots], want[2 + j][0])
        assert torch.equal(scales[j].view(-1, hkv)[slots], want[2 + j][1])


@pytest.mark.parametrize("m,n,k,bias", [(1, 6144, 4096, False), (3, 4096, 4096, True), (16, 4096, 14336, False),
                                        (16, 28672, 4096, False), (64, 1024, 4096, True), (37, 4096, 512, False)])
def test_fp8_few_rows_gemm_matches_scaled_mm_and_replays_in_a_graph(m, n, k, bias):
    """kernels/fp8_small_gemm.py (FP8 MMAs, K split or not; a split's partials summed by a second kernel)
    against torch._scaled_mm on the same FP8 operands (fp32 sums in another
    order, one bf16 rounding), eagerly and replayed from a CUDA graph on new rows; and fp8.linear takes it
    for these rows (the default launch)."""
    from burstserve.kernels import fp8
    from burstserve.kernels import fp8_small_gemm as sg
    w = fp8.quantize_weight(torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16) if bias else None
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16) * torch.rand(m, 1, device=DEV) * 4
    xq, xs = fp8.quantize_rows(x)

    def cublas():
        return torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.scale, bias=b, out_dtype=torch.bfloat16)

    out = sg.scaled_mm_few_rows(xq, xs, w, b, torch.bfloat16)
    assert sg._triton.enabled and out is not None, "the Triton kernel failed or declined"
    scales = xs.double() * w.scale.double()
    exact = (xq.double() @ w.weight.double().t()) * scales
    exact = exact if b is None else exact + b.double()
    terms = (xq.double().abs() @ w.weight.double().abs().t()) * scales            # sum_k |x_k w_k|
    # each element: one bf16 rounding (2^-8 relative) of a sum the FP8 MMAs keep to ~14 bits between
    # their moves into fp32 (bounded by the terms' magnitudes); cuBLAS's sum may round the other way
    err = (out.double() - exact).abs()
    assert (err <= exact.abs() * 2**-8 + terms * 2**-10).all(), (err - exact.abs() * 2**-8).max()
    assert ((out.double() - cublas().double()).abs() <= exact.abs() * 2**-7 + terms * 2**-10).all()
    # and as close to the exact product as cuBLAS's, over the whole output
    assert err.norm() <= 1.25 * (cublas().double() - exact).norm(), (err.norm(), (cublas().double() - exact).norm())
    assert torch.equal(fp8.linear(fp8.Fp8Rows(xq, xs, torch.bfloat16), w, b), out)   # deterministic, and used
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed = sg.scaled_mm_few_rows(xq, xs, w, b, torch.bfloat16)
    new_q, new_s = fp8.quantize_rows(torch.randn(m, k, device=DEV, dtype=torch.bfloat16))
    xq.copy_(new_q)
    xs.copy_(new_s)
    for _ in range(2):
        g.replay()
        want = cublas().double()
        terms = (xq.double().abs() @ w.weight.double().abs().t()) * xs.double() * w.scale.double()
        assert ((graphed.double() - want).abs() <= want.abs() * 2**-7 + terms * 2**-10).all()


needs_fa3 = pytest.mark.skipif(not torch.cuda.is_available() or fa3_fp8_refusal(DEV) is not None,
                               reason="needs Hopper and fa3-fwd (carry .fa3: scripts/README.md)")


@needs_fa3
@pytest.mark.parametrize("sq,sk,segment", [(2048, 2048, 1 << 20), (1024, 4096, 1 << 20), (3000, 3000, 1024)])
def test_fa3_fp8_kernel_rounds_as_its_torch_path(sq, sk, segment):
    """FlashAttention-3's FP8 forward against kernels/fa3_fp8.py's torch path on the same operands (causal,
    end-aligned, in one call and in segments): far closer to each other than either is to float64 (the running
    maximum and the dots' order are the kernel's; each is 0.047-0.054 from float64)."""
    gen = torch.Generator(device=DEV).manual_seed(random.randrange(1 << 30))
    q = torch.randn(sq, 32, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(sk, 8, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(sk, 8, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
    kern, kern_lse = fa3_fp8_attention(q, k, v, True, 128 ** -0.5, segment=segment, kernel="fa3")
    ref, ref_lse = fa3_fp8_attention(q, k, v, True, 128 ** -0.5, segment=segment, kernel="torch")
    visible = torch.arange(sk, device=DEV)[None, :] <= torch.arange(sq, device=DEV)[:, None] + (sk - sq)
    heads = lambda t: t.float().repeat_interleave(32 // t.shape[1], 1).transpose(0, 1)   # noqa: E731  [H, S, D]
    exact = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=visible,
                                                             scale=128 ** -0.5).transpose(0, 1)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()    # noqa: E731
    assert 0.02 < rel(ref, exact) < 0.08 and 0.02 < rel(kern, exact) < 0.08, (rel(ref, exact), rel(kern, exact))
    assert rel(kern, ref) < 0.6 * rel(ref, exact), (rel(kern, ref), rel(ref, exact))
    assert (kern_lse - ref_lse).abs().max() < 5e-3


@pytest.mark.parametrize("s,hx,hkv,strided", [(8192, 32, 8, False), (4099, 8, 8, True), (3, 32, 8, True)])
def test_fa3_fp8_cast_kernels_give_the_torch_paths_bits(s, hx, hkv, strided):
    """kernels/fa3_fp8.py's Triton casts (bf16 in, rows of the fused QKV's stride or contiguous) against its torch
    path on the same GPU: the same scales and e4m3 bytes."""
    from burstserve.kernels import fa3_fp8
    gen = torch.Generator(device=DEV).manual_seed(random.randrange(1 << 30))
    qkv = torch.randn(s, hx + 2 * hkv, 128, device=DEV, dtype=torch.bfloat16, generator=gen)   # rows of the fused QKV
    rows = torch.rand(s, 1, 1, device=DEV, generator=gen) * 30                         # rows of unlike sizes
    x = qkv[:, :hx] if strided else (qkv[:, :hx] * rows).to(torch.bfloat16).contiguous()
    kern = fa3_fp8._triton.kernels(DEV)
    assert kern is not None, "the cast kernels did not build"
    got8, got_scale = fa3_fp8._to_e4m3_triton(kern, x, hkv)
    want8, want_scale = fa3_fp8._to_e4m3_torch(x, hkv)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8))
    x = x.clone()
    x[s // 2, 0, 1], x[-1, -1, 0] = float("nan"), float("inf")      # the first group a NaN, the last an inf
    got8, got_scale = fa3_fp8._to_e4m3_triton(kern, x, hkv)
    want8, want_scale = fa3_fp8._to_e4m3_torch(x, hkv)
    torch.testing.assert_close(got_scale, want_scale, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got8.float().isnan(), want8.float().isnan()) and got8.float().isnan().any()


def test_fa3_fp8_cast_kernels_divide_exactly_on_ties_and_signed_zeros():
    """The cast kernel's division (a reciprocal a program, two FMAs a value) against the torch path's true
    division, where a multiply by the reciprocal goes wrong: values on e4m3's grid and half-way between pairs of
    them, times a scale that is not a power of two (many quotients land exactly on e4m3 values and ties),
    with -0, +0, values e4m3 takes to its subnormals or to 0, and one group whose scale is inf (a value inf)."""
    from burstserve.kernels import fa3_fp8
    from test_fa3_fp8_casts import TIE_SCALES, _ties
    s, hx, hkv = 4096, 8, 4
    x = _ties(torch.Generator().manual_seed(random.randrange(1 << 30)), s, 128).to(DEV)   # rows 1, 2: -0, +0
    scale = TIE_SCALES.to(DEV)
    kern = fa3_fp8._triton.kernels(DEV)
    assert kern is not None, "the cast kernels did not build"
    got8, got_scale = fa3_fp8._to_e4m3_triton(kern, x, hkv)
    want8, want_scale = fa3_fp8._to_e4m3_torch(x, hkv)
    assert torch.equal(got_scale, want_scale) and torch.equal(got_scale, scale)
    assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8))
    assert (got8.view(torch.uint8)[1, :, :4] == 0x80).all() and (got8.view(torch.uint8)[2, :, :4] == 0).all()
    by_reciprocal = (x.view(s, hkv, -1) * (1.0 / scale)[None, :, None]).clamp(-448, 448)
    by_reciprocal = by_reciprocal.to(torch.float8_e4m3fn).view(s, hx, 128)
    assert not torch.equal(by_reciprocal.view(torch.uint8), want8.view(torch.uint8))   # the case has ties to miss
    x[5, -1, 3] = float("inf")                                                     # the last group's scale inf
    got8, got_scale = fa3_fp8._to_e4m3_triton(kern, x, hkv)
    want8, want_scale = fa3_fp8._to_e4m3_torch(x, hkv)
    assert got_scale[-1].isinf() and torch.equal(got_scale, want_scale)
    nan = want8.float().isnan()                                                    # inf / inf, one value
    assert torch.equal(got8.float().isnan(), nan) and nan.sum() == 1
    assert torch.equal(got8.view(torch.uint8)[~nan], want8.view(torch.uint8)[~nan])   # the rest of it: signed 0s


@pytest.mark.parametrize("s,hx,hkv,strided", [(8192, 32, 8, False), (4099, 8, 8, True), (3, 32, 8, True)])
def test_fa3_fp8_cast_kernels_turn_the_rows_as_the_torch_path(s, hx, hkv, strided):
    """kernels/fa3_fp8.py's Triton casts with the rotation (bf16 rows, each head's row times the [128, 128] signed
    Hadamard matrix inside the kernels, fp32 sums rounded to bf16) against its torch path (x @ turn in bf16, then
    the cast) on the same GPU: scales within a bf16 rounding, bytes equal but for the rare sum that lands on a tie
    (the sums' order differs), and what the bytes dequantize to is x @ turn within e4m3's rounding."""
    from burstserve.kernels import fa3_fp8
    from test_fa3_fp8_casts import assert_rotated_cast
    gen = torch.Generator(device=DEV).manual_seed(random.randrange(1 << 30))
    qkv = torch.randn(s, hx + 2 * hkv, 128, device=DEV, dtype=torch.bfloat16, generator=gen)
    rows = torch.rand(s, 1, 1, device=DEV, generator=gen) * 30
    x = qkv[:, :hx] if strided else (qkv[:, :hx] * rows).to(torch.bfloat16).contiguous()
    turn = fa3_fp8.rotation(128, torch.bfloat16, x.device)
    kern = fa3_fp8._triton.kernels(DEV)
    assert kern is not None, "the cast kernels did not build"
    got8, got_scale = fa3_fp8._to_e4m3_triton(kern, x, hkv, turn)
    want8, want_scale = fa3_fp8._to_e4m3_torch(x, hkv, turn)
    assert_rotated_cast(got8, got_scale, want8, want_scale, x, hkv, turn)


@pytest.mark.parametrize("rows", [1, 7, 300, 5000])
def test_grouped_experts_match_the_routed_experts_in_fp64(rows):
    """engine/model/moe.grouped_experts on a GPU (torch's CUTLASS grouped GEMMs, bf16; the prefill's experts) against
    routed_experts in fp64 on the same bf16 weights, rows and routing (fixed, so no router near-tie can move a row):
    apart by bf16 roundings only (the silu*up rows and the outputs). 128 experts, top 8, as Qwen3-30B-A3B's."""
    from burstserve.engine.model.moe import ExpertWeights, grouped_experts, route, routed_experts
    E, k, hidden, inter = 128, 8, 1024, 384
    bf = torch.bfloat16
    experts = ExpertWeights(router=torch.randn(E, hidden, device=DEV, dtype=bf),
                            gate_up=torch.randn(E, 2 * inter, hidden, device=DEV, dtype=bf) * hidden ** -0.5,
                            down=torch.randn(E, hidden, inter, device=DEV, dtype=bf) * inter ** -0.5,
                            top_k=k, renormalize=True, weights_fp32=False)
    x = torch.randn(rows, hidden, device=DEV, dtype=bf)
    weights, chosen = route(x, experts)
    got = grouped_experts(x, experts, weights, chosen).double().cpu()
    wide = ExpertWeights(**{**vars(experts), "gate_up": experts.gate_up.double().cpu(),
                            "down": experts.down.double().cpu(), "router": experts.router.double().cpu()})
    want = routed_experts(x.double().cpu(), wide, weights.double().cpu(), chosen.cpu())
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"grouped experts, {rows} rows: max |err| / max {err:.2e}")
    assert err < 2e-2, err
    assert torch.equal(grouped_experts(x, experts, weights, chosen), grouped_experts(x, experts, weights, chosen))


@pytest.mark.parametrize("rows,experts,k,renormalize,dtype", [(1, 128, 8, True, torch.bfloat16),
                                                             (16384, 128, 8, True, torch.bfloat16),
                                                             (37, 8, 2, True, torch.float32),
                                                             (300, 60, 4, False, torch.float32)])
def test_the_router_kernel_matches_torch_on_the_gpu(rows, experts, k, renormalize, dtype):
    """kernels/moe_route.py's one kernel against the torch ops on the same GPU (softmax, torch.topk, renormalize):
    the same weights within fp32's summation order, and the experts of a stable sort of the probabilities (bf16
    logits tie often; torch.topk on CUDA takes the lower index at the k-th place too, but orders equal values as it
    likes)."""
    from burstserve.kernels import moe_route as mr
    logits = (torch.randn(rows, experts, device=DEV) * 3).to(dtype)
    out_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    w, i = mr.route_top_k(logits, k, renormalize, out_dtype)
    want_w, want_topk = mr.route_torch(logits, k, renormalize, out_dtype)
    probs = torch.softmax(logits.float(), dim=-1)
    want_i = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    assert mr._triton.enabled
    assert torch.equal(i, want_i)
    assert torch.equal(i.sort(dim=-1).values, want_topk.sort(dim=-1).values)   # the same experts as torch.topk's
    tol = dict(atol=1e-6, rtol=1e-5) if out_dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)   # bf16: an ulp
    torch.testing.assert_close(w.float(), want_w.float(), **tol)

"""Decode attention over FP8 pages (kernels/fp8_paged_attention.py): the torch reference equals attention in
float64 over K/V rounded alike (kernels.kv_quant.round_kv) and the gathered paged_attention over the same
pages; the Triton kernel, in Triton's interpreter on the CPU, equals the reference for every split count
(more splits than pages too), padding rows, GQA and MHA, pages in any order."""
import math
import random

import torch

from burstserve.kernels import fp8_paged_attention as fpa
from burstserve.kernels.kv_quant import Fp8Pages, quantize_kv, round_kv
from burstserve.kernels.paged_attention import paged_attention
from triton_interpreter import run_interpreted


def fp8_pool(lens, hkv, d, bs, g, seed=None, spread=1.0, stale_nan=False):
    """Random K/V (an outlier channel in K, rows of random magnitude exp(spread N(0,1))) for sequences of
    these lengths, written into shuffled pages of an FP8 pool -> (k_pages, v_pages, table [B, P] int32, the
    rounded K/V per sequence [2, n, Hkv, D] fp64). The slots no sequence holds are 0, as in the engine's
    pool (zeroed on GPUs); stale_nan: NaN patterns instead (bytes 0x7F, NaN scales), for kernels that must
    not use those slots even as 0 x value."""
    width = max(1, max(math.ceil(n / bs) for n in lens))
    num_blocks = 1 + sum(math.ceil(n / bs) for n in lens) + 3
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    byte, scale = (0x7F, float("nan")) if stale_nan else (0, 0.0)                        # 0x7F: e4m3's NaN
    data = [torch.full((num_blocks, bs, hkv, d), byte, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.full((num_blocks, bs, hkv), scale, dtype=torch.bfloat16) for _ in range(2)]
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    rounded = []
    for b, n in enumerate(lens):
        pages = [free.pop() for _ in range(math.ceil(n / bs))]
        table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        slots = torch.tensor([pages[i // bs] * bs + i % bs for i in range(n)], dtype=torch.long)
        kv = torch.randn(2, n, hkv, d, generator=g) * torch.exp(spread * torch.randn(2, n, hkv, 1, generator=g))
        kv[0, :, :, 3] *= 20                                                # an outlier channel in K
        for j in range(2):
            q8, s8 = quantize_kv(kv[j])
            data[j].view(-1, hkv, d)[slots] = q8
            scales[j].view(-1, hkv)[slots] = s8
        rounded.append(round_kv(kv).double())
    return Fp8Pages(data[0], scales[0]), Fp8Pages(data[1], scales[1]), table, rounded


def _case(lens, h=8, hkv=2, d=64, bs=16, dtype=torch.float32, seed=None):
    """Random sequences of these lengths in an FP8 pool (fp8_pool, NaN patterns in the slots past each length:
    the decode kernel loads whole tiles and must replace them) and one query each: (q [B, H, D], k_pages,
    v_pages, table [B, P] int32, lens [B] int32, the rounded K/V per sequence [2, n, Hkv, D] (fp64))."""
    g = torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))
    kp, vp, table, rounded = fp8_pool(lens, hkv, d, bs, g, seed, stale_nan=True)
    q = (torch.randn(len(lens), h, d, generator=g)).to(dtype)
    return q, kp, vp, table, torch.tensor(lens, dtype=torch.int32), rounded


def _float64_attention(q, rounded, scale):
    """Each row's attention in float64 over its rounded K/V -> (out [B, H, D], lse [B, H])."""
    b, h, d = q.shape
    out, lse = torch.zeros(b, h, d, dtype=torch.float64), torch.full((b, h), float("-inf"), dtype=torch.float64)
    for i, kv in enumerate(rounded):
        if kv.shape[1] == 0:
            continue
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in kv)          # [n, H, D]
        s = torch.einsum("hd,nhd->hn", q[i].double(), k) * scale
        lse[i] = torch.logsumexp(s, -1)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)
    return out, lse


def test_reference_is_attention_over_the_rounded_kv_and_the_gathered_paged_path():
    lens = [0, 1, 16, 37, 100]
    q, kp, vp, table, seq_lens, rounded = _case(lens)
    scale = 64 ** -0.5
    out, lse = fpa.fp8_paged_decode_reference(q, kp, vp, table, seq_lens, scale)
    want, want_lse = _float64_attention(q, rounded, scale)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)             # fp32 sums (a draw: 1.5e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    gathered, gathered_lse = paged_attention(q, kp, vp, table, cu, seq_lens, scale, causal=False,
                                             backend="reference", max_seqlen_q=1)
    # two fp32 paths summing in different orders (a draw differed by 1.25e-5): the bound held against float64
    torch.testing.assert_close(out, gathered, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, gathered_lse, atol=1e-5, rtol=1e-5)


def test_the_split_count_fills_the_sms_and_keeps_splits_long():
    assert fpa.choose_splits(1, 8, 131072, 132) == 49                 # 1 x 128K: 8 heads x 49 ~ 3 waves
    assert fpa.choose_splits(16, 8, 8192, 132) == 3                   # 16 x 8K: 128 x 3 ~ 3 waves
    assert fpa.choose_splits(64, 8, 2048, 132) == 1
    assert fpa.choose_splits(1, 8, 1024, 132) == 2                    # at least 512 keys a split
    assert fpa.choose_splits(1, 1, 1 << 20, 1000) == fpa.MAX_SPLITS


def _triton_interpreted_checks():
    import warnings
    warnings.simplefilter("ignore", RuntimeWarning)          # numpy: exp/log of -inf in masked lanes
    kern = fpa._build()
    assert type(kern["decode"]).__name__ == "InterpretedFunction", type(kern["decode"])
    # bf16 is left to the GPU test: the interpreter keeps bf16 as raw uint16, and its tl.dot multiplies those
    for h, hkv, d, dtype in ((8, 2, 64, torch.float16), (4, 4, 32, torch.float16), (8, 2, 64, torch.float32)):
        lens = [0, 1, 16, 37, 100]
        q, kp, vp, table, seq_lens, rounded = _case(lens, h, hkv, d, dtype=torch.float32)
        q = q.to(dtype)
        scale = d ** -0.5
        want, want_lse = fpa.fp8_paged_decode_reference(q, kp, vp, table, seq_lens, scale)
        for splits, tile in ((1, 16), (3, 8), (9, 16)):              # 9 > the longest row's 7 pages; 2 tiles a page
            out, lse = fpa._decode_triton(kern["decode"], q, kp, vp, table, seq_lens, scale, splits, block_keys=tile)
            torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)   # P in the compute dtype
            torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
            assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()


def test_fp8_decode_kernel_interpreted():
    run_interpreted("test_fp8_paged_attention")

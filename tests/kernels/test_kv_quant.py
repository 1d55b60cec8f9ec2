"""The FP8 KV format (kernels/kv_quant.py) against its definition, built here from first principles: every
finite float8_e4m3fn value listed from its bits, the scale max |row| / 448 rounded to the nearest bf16,
each element the nearest listed value to x / scale (clamped to 448; ties to the even bit pattern)."""
import random

import torch

from burstserve.kernels.kv_quant import dequantize_kv, pack_kv, quantize_kv, round_kv, unpack_kv
from triton_interpreter import run_interpreted


def e4m3_values() -> torch.Tensor:
    """The 127 non-negative finite e4m3fn values, from sign 0, 4 exponent bits (bias 7), 3 mantissa bits
    (S.1111.111 is NaN), ascending; index = the byte's low 7 bits."""
    values = []
    for bits in range(127):
        exp, man = bits >> 3, bits & 7
        values.append(man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return torch.tensor(values, dtype=torch.float64)


def nearest(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """x [...] (float64, |x| <= 448) -> the nearest grid value in magnitude, sign kept; ties to the even
    index (the even bit pattern)."""
    a = x.abs().flatten()
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo % 2 == 0, lo, hi)))
    return (grid[pick] * x.flatten().sign()).view(x.shape)


def _rows(n=300, d=64, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))
    x = torch.randn(n, 2, d, generator=g) * torch.exp(torch.randn(n, 2, 1, generator=g) * 4)
    x[:, :, 7] *= 40                                    # an outlier channel, as trained models' keys have
    x[5] = 0                                            # all-zero rows
    x[9, 0] = torch.rand(x.shape[-1], generator=g)      # a row whose max is exactly 448
    x[9, 0, :3] = torch.tensor([448.0, -448.0, 224.0])
    return x


def _scale(x: torch.Tensor) -> torch.Tensor:
    """max |row| / 448 rounded to the nearest bf16 (an all-zero row: 2^-126), as float64 [...]."""
    return (x.double().abs().amax(-1) / 448).clamp(min=2.0 ** -126).to(torch.bfloat16).double()


def test_each_rows_scale_is_its_largest_magnitude_over_448_and_the_largest_lands_on_448():
    x = _rows()
    data, scale = quantize_kv(x)
    assert scale.dtype == torch.bfloat16 and torch.equal(scale.double(), _scale(x))
    top = data.view(torch.float8_e4m3fn).float().abs().amax(-1)
    assert (top[x.abs().amax(-1) > 0] == 448).all()                   # the row's largest element is exact
    assert torch.equal(round_kv(x)[9, 0, :2], torch.tensor([448.0, -448.0]))


def test_each_element_is_the_nearest_e4m3_value_of_its_scaled_self():
    x = _rows().double()
    data, scale = quantize_kv(x.float())
    s = scale.double().unsqueeze(-1)
    want = nearest((x.float().double() / s).clamp(-448, 448), e4m3_values())
    got = dequantize_kv(data, scale, torch.float64) / s
    assert torch.equal(got, want)


def test_error_bounds_zero_rows_and_outliers():
    x = _rows()
    y = round_kv(x)
    s = _scale(x).unsqueeze(-1)
    normal = x.double().abs() >= 2.0 ** -6 * s                         # e4m3's normal range, scaled
    rel = ((y - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -4 * (1 + 2.0 ** -7)                     # half an ulp of 3 mantissa bits
    assert ((y - x).abs().double()[~normal] <= 2.0 ** -10 * s.expand_as(x)[~normal] * 1.01).all()
    assert torch.equal(y[5], torch.zeros_like(y[5])) and torch.isfinite(y).all()
    # per (token, head) scales: an outlier costs only its own row's precision
    z = x.clone()
    z[0, 0, 0] = 1e6
    assert torch.equal(round_kv(z)[1:], y[1:]) and torch.equal(round_kv(z)[0, 1], y[0, 1])


def test_values_come_back_exact_in_fp32_and_rounding_twice_changes_nothing():
    x = _rows()
    data, scale = quantize_kv(x)
    exact = data.view(torch.float8_e4m3fn).double() * scale.double().unsqueeze(-1)
    assert torch.equal(dequantize_kv(data, scale, torch.float32).double(), exact)    # 4 x 8 bits fit fp32
    y = round_kv(x)
    assert torch.equal(round_kv(y), y)
    assert [torch.equal(a, b) for a, b in zip(quantize_kv(y), (data, scale))] == [True, True]   # same bytes
    assert data.dtype == torch.uint8 and scale.shape == x.shape[:-1]
    assert torch.equal(unpack_kv(pack_kv(x), torch.float32), y) and pack_kv(x).shape[-1] == x.shape[-1] + 2


def test_fused_kernels_interpreted():
    run_interpreted("test_kv_quant")


def _fp16_safe(x):
    """x within fp16's normal range: finite, and no subnormals (the interpreter's fp16 loads lose them)."""
    x = x.clamp(-6e4, 6e4)
    return torch.where(x.abs() < 2.0 ** -14, 0.0, x)


def _triton_interpreted_checks():
    """Run in a TRITON_INTERPRET=1 process (see test_fused_kernels_interpreted): the one-kernel round_kv_ and
    store_kv_fp8 give the torch ops' bytes, scales and values exactly (rows of a fused QKV output, binade
    edges, zero rows, an outlier channel), and the gather kernel dequantize_kv's values bit for bit."""
    from burstserve.kernels import kv_quant
    build = kv_quant._build()
    for dtype in (torch.float32, torch.float16):        # bf16: the interpreter loads its raw bits (GPU test)
        n, hkv, d = 37, 3, 64
        qkv = _rows(n * 5, d).view(n, 4 + 2 * hkv, d)                             # q 4 heads, k, v hkv each
        qkv[:, 4:4 + hkv, 5] *= 20                                                # an outlier channel in K
        qkv = _fp16_safe(qkv).to(dtype)
        qkv[3, 4:] = 0                                                            # a zero row
        qkv[7, 4, :8] = torch.tensor([31.9, -31.9, 15.97, 448.0, 0.1, -0.1, 1e-3, 2.0])   # binade edges
        k, v = qkv[:, 4:4 + hkv], qkv[:, 4 + hkv:]
        assert kv_quant._rows_ok(k, v) == (dtype != torch.float16)      # fp16: the engine takes the torch ops
        want_k, want_v = round_kv(k), round_kv(v)
        kv_quant._quantize_triton(build["quantize"], k, v, None, None, None, None, None, write_back=True)
        assert torch.equal(k, want_k) and torch.equal(v, want_v), dtype
        pages, bs = 7, 8
        data = [torch.zeros(pages, bs, hkv, d, dtype=torch.uint8) for _ in range(2)]
        scales = [torch.zeros(pages, bs, hkv, dtype=torch.bfloat16) for _ in range(2)]
        slots = torch.randperm(pages * bs)[:n]
        x = [_fp16_safe(_rows(n * 3, d).view(n, 2 * hkv, d)[:, :hkv]).to(dtype) for _ in range(2)]
        kv_quant._quantize_triton(build["quantize"], x[0], x[1], data[0], scales[0], data[1], scales[1], slots,
                                  write_back=False)
        for j in range(2):
            q8, s8 = quantize_kv(x[j])
            assert torch.equal(data[j].view(-1, hkv, d)[slots], q8), (dtype, j)
            assert torch.equal(scales[j].view(-1, hkv)[slots], s8), (dtype, j)
    # the gather kernel: pages in a shuffled order, a partial last page, bf16 and fp32 out, tiny scales too
    from burstserve.kernels.kv_quant import Fp8Pages
    x = _rows(30 * 8 * 2, 64).view(30, 8, 4, 64)[:, :, :3].contiguous()
    x[4] *= 1e-37                                                                 # scales near MIN_SCALE
    data, scale = quantize_kv(x)
    pages = Fp8Pages(data, scale)
    blocks = torch.randperm(30)[:17]
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 16, 131):
            want = dequantize_kv(data[blocks].flatten(0, 1)[:n], scale[blocks].flatten(0, 1)[:n], dtype)
            got = kv_quant._gather_triton(build["gather"], pages, blocks, n, dtype)
            assert torch.equal(got.view(torch.uint8) if dtype == torch.bfloat16 else got,
                               want.view(torch.uint8) if dtype == torch.bfloat16 else want), (dtype, n)


def test_pages_gather_in_the_compute_dtype_gives_dequantize_kvs_values():
    """Fp8Pages.gather multiplies in bf16 (no fp32 copy of a long context): the same values as the exact
    fp32 product rounded once."""
    from burstserve.kernels.kv_quant import Fp8Pages
    x = _rows(50 * 16, 64).view(50, 16, 2, 64)
    data, scale = quantize_kv(x)
    pages = Fp8Pages(data, scale)
    blocks = torch.randperm(50)[:20]
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        want = dequantize_kv(data[blocks].flatten(0, 1)[:300], scale[blocks].flatten(0, 1)[:300], dtype)
        assert torch.equal(pages.gather(blocks, 300, dtype), want), dtype

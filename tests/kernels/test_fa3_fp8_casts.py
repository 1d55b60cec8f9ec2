"""kernels/fa3_fp8.py's Triton casts to e4m3 (the group maxima, then the cast), in Triton's interpreter on the CPU:
the same bits as the torch path (scales and bytes), over rows of any stride, groups of one head or several, a row
block cut by the tensor's end, a group width not a power of two, values past e4m3's normal range, a group of zeros
(the smallest scale); a NaN or an inf reaches its group's scale and values as in the torch path. With the rotation
(each head's row times the [D, D] matrix, fp32 sums rounded to x's dtype, inside the kernels): the torch path's
values, which sum in another order (a scale within a rounding of x's dtype, a byte in a thousand at most one e4m3
step away), and what the bytes dequantize to is x @ turn within e4m3's rounding."""
import torch

from burstserve.kernels import fa3_fp8
from triton_interpreter import run_interpreted


def test_cast_kernels_interpreted():
    run_interpreted("test_fa3_fp8_casts")


def _cases():
    g = torch.Generator().manual_seed(7)
    for s, hx, hkv, d in ((37, 8, 2, 64), (5, 4, 4, 32), (300, 32, 8, 16), (1, 2, 1, 16), (19, 5, 1, 32)):
        x = torch.randn(s, hx, d, generator=g) * torch.rand(s, 1, 1, generator=g) * 30
        x[0, 0, 0] = 1e-7                                          # far below e4m3's normal range after scaling
        if hkv > 1:
            x[:, -(hx // hkv):] = 0                                # the last group all zeros
        yield x, hkv
        wide = torch.empty(s, hx + 3, d)[:, :hx]                   # rows of stride (hx + 3) * d
        wide.copy_(x)
        yield wide.to(torch.float16), hkv
    yield _ties(g), 4
    bad = torch.randn(40, 8, 16, generator=g)
    bad[3, 1, 5], bad[30, 6, 0] = float("nan"), float("inf")    # group 0 takes a NaN, group 1 an inf
    yield bad, 2


def _ties(g: torch.Generator, s: int = 64, d: int = 32) -> torch.Tensor:
    """[s, 8, d] fp32 in 4 groups (tests/gpu's casts take it too): e4m3 values and the midpoints of pairs of them
    (a neighbours' midpoint is a tie; down to the subnormals and below), -0 and +0 (rows 1 and 2), times a scale a
    group that is not a power of two (TIE_SCALES), its largest 448 s: many quotients land exactly on an e4m3 value
    or a tie, where a multiply by the reciprocal rounds the wrong way (some 50-70 bytes at 64 x 8 x 32)."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid.abs() <= 448)]
    mids = (grid[None] + grid[:, None]).flatten() / 2
    t = mids[torch.randint(0, mids.numel(), (s, 8, d), generator=g)]
    t = t * 2.0 ** torch.randint(-12, 1, (s, 8, 1), generator=g).float()
    t[0, :, 0], t[1, :, :4], t[2, :, :4] = 448.0, -0.0, 0.0
    return (t.view(s, 4, -1) * TIE_SCALES[None, :, None]).view(s, 8, d)


# _ties' scales a group: not powers of two, of 8 significant bits (448 s and t s exact in fp32)
TIE_SCALES = torch.tensor([1.3, 0.7, 3.1e-20, 5.0e18]).to(torch.bfloat16).float()


def _rotated_cases():
    g = torch.Generator().manual_seed(11)
    for s, hx, hkv, d, dtype in ((37, 8, 2, 64, torch.float32), (300, 32, 8, 16, torch.float16),
                                 (19, 5, 1, 32, torch.bfloat16), (3, 4, 1, 128, torch.bfloat16)):
        x = (torch.randn(s, hx, d, generator=g) * torch.rand(s, 1, 1, generator=g) * 30).to(dtype)
        yield x, hkv, fa3_fp8.rotation(d, dtype, x.device)
        wide = torch.empty(s, hx + 2, d, dtype=dtype)[:, :hx]     # rows of stride (hx + 2) * d
        wide.copy_(x)
        yield wide, hkv, fa3_fp8.rotation(d, dtype, x.device)


def assert_rotated_cast(got8, got_scale, want8, want_scale, x, hkv, turn):
    """The kernels' rotated cast against the torch path's (see the module docstring)."""
    ulp = {torch.float32: 4e-7, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[x.dtype]
    torch.testing.assert_close(got_scale, want_scale, rtol=ulp, atol=0)     # the largest turned value's rounding
    assert got8.shape == x.shape and got8.is_contiguous()
    got, want = got8.float(), want8.float()
    differ = got != want
    assert differ.sum() <= max(1, differ.numel() // 1000), differ.sum()
    assert ((got - want).abs() <= want.abs() / 8 + 2.0 ** -9)[differ].all()
    turned = (x @ turn).float().view(x.shape[0], hkv, -1)                # turned in x's dtype, as both paths
    back = (got.view(x.shape[0], hkv, -1) * got_scale[None, :, None])
    step = turned.abs() / 16 + got_scale[None, :, None] * 2.0 ** -9     # half an e4m3 step, or a subnormal's
    assert ((back - turned).abs() <= step * 1.001).all()


def _triton_interpreted_checks():
    """Run in a TRITON_INTERPRET=1 process (see test_cast_kernels_interpreted)."""
    kern = fa3_fp8._build()
    for x, hkv, turn in _rotated_cases():
        got8, got_scale = fa3_fp8._to_e4m3_triton(kern, x, hkv, turn)
        want8, want_scale = fa3_fp8._to_e4m3_torch(x, hkv, turn)
        assert_rotated_cast(got8, got_scale, want8, want_scale, x, hkv, turn)
    for x, hkv in _cases():
        if not x.isfinite().all():          # a NaN or inf reaches its group's scale and values, as in torch
            got8, got_scale = fa3_fp8._to_e4m3_triton(kern, x, hkv)
            want8, want_scale = fa3_fp8._to_e4m3_torch(x, hkv)
            torch.testing.assert_close(got_scale, want_scale, rtol=0, atol=0, equal_nan=True)
            assert got_scale[0].isnan() and got_scale[1].isinf()
            assert torch.equal(got8.float().isnan(), want8.float().isnan())
            assert got8.float().isnan().any()
            continue
        got8, got_scale = fa3_fp8._to_e4m3_triton(kern, x, hkv)
        want8, want_scale = fa3_fp8._to_e4m3_torch(x, hkv)
        assert torch.equal(got_scale, want_scale), (x.shape, x.stride(), got_scale, want_scale)
        assert got8.shape == x.shape and got8.is_contiguous()
        assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8)), (x.shape, x.stride())
        assert got8.float().abs().max() == 448                     # the largest value maps to e4m3's largest

"""kernels/moe_grouped.py: the grouped experts' silu*up times the routing weights and the sum of each row's choices,
run by Triton's interpreter on the CPU, against their torch ops (the CPU's path) and against fp64 on fresh random
rows, orders and widths that are not multiples of the kernels' block; the torch ops against fp64 in every dtype."""
import random

import torch
import torch.nn.functional as F

from burstserve.kernels import moe_grouped as mg
from triton_interpreter import run_interpreted


def _case(rows: int, k: int, inter: int, hidden: int, dtype: torch.dtype):
    up = torch.randn(rows * k, 2 * inter).to(dtype)
    scale = torch.rand(rows * k).to(dtype)
    y = torch.randn(rows * k, hidden).to(dtype)
    slot = torch.randperm(rows * k)
    want_act = (F.silu(up.double()[:, :inter]) * up.double()[:, inter:] * scale.double()[:, None])
    want_sum = y.double()[slot].view(rows, k, hidden).sum(dim=1)
    return up, scale, y, slot, want_act, want_sum


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within one rounding to dtype (and fp32 sums' error) of the fp64 value."""
    eps = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=4 * eps * want.abs().max().item(), rtol=eps)


def test_the_torch_ops_round_once_from_fp64():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows, k = random.randint(1, 40), random.choice([1, 2, 8])
        up, scale, y, slot, want_act, want_sum = _case(rows, k, random.randint(1, 300), random.randint(1, 300), dtype)
        _close(mg.silu_mul_scaled(up, scale), want_act, dtype)
        _close(mg.sum_choices(y, slot, k), want_sum, dtype)
        _close(mg.sum_choices(y.float(), None, k, dtype), y.double().view(rows, k, -1).sum(dim=1), dtype)


def _triton_interpreted_checks():
    kern = mg._build()
    assert type(kern["sum_choices"]).__name__ == "InterpretedFunction", type(kern["sum_choices"])
    for dtype in (torch.float32, torch.bfloat16):
        for rows, k, inter, hidden in ((1, 1, 16, 16), (3, 8, 48, 80), (random.randint(2, 20), random.choice([2, 4]),
                                       random.randint(1, 1500), random.randint(1, 1500))):
            up, scale, y, slot, want_act, want_sum = _case(rows, k, inter, hidden, dtype)
            act = mg._silu_mul_scaled_triton(kern["silu_mul_scaled"], up, scale)
            total = mg._sum_choices_triton(kern["sum_choices"], y, slot, k)
            _close(act, want_act, dtype)
            _close(total, want_sum, dtype)
            in_order = mg._sum_choices_triton(kern["sum_choices"], y.float(), None, k, dtype)   # no slots: j's order
            _close(in_order, y.double().view(rows, k, hidden).sum(dim=1), dtype)
            if dtype == torch.float32:       # the torch ops: the same values, fp32's summation order apart
                torch.testing.assert_close(act, mg.silu_mul_scaled(up, scale), atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(total, mg.sum_choices(y, slot, k), atol=1e-5, rtol=1e-5)


def test_the_kernels_interpreted():
    run_interpreted("test_moe_grouped")

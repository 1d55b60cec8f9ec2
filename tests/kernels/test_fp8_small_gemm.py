"""kernels/fp8_small_gemm.py: the few-rows FP8 GEMM, run by Triton's interpreter on the CPU, equals the
scaled product of its FP8 operands written out in fp64 (and torch._scaled_mm's answer) for row counts, K
splits, biases and strided rows; the split chooser fills the SMs; shapes it does not take go to cuBLAS.
(The GPU test, tests/gpu/test_kernels_gpu.py, checks the FP8 MMA itself against torch._scaled_mm.)"""
import random

import pytest
import torch

from burstserve.kernels import fp8
from burstserve.kernels import fp8_small_gemm as sg
from triton_interpreter import run_interpreted


def _operands(m: int, n: int, k: int, bias: bool):
    """Random FP8 rows (a strided view: one row of a wider buffer) and weight, as the engine makes them."""
    wide = (torch.randn(m, k + 64) * torch.rand(m, 1) * 4).to(torch.bfloat16)
    xq, xs = fp8.quantize_rows(wide[:, :k].contiguous())
    buffer = torch.zeros(m, k + 32, dtype=fp8.FP8)
    buffer[:, :k] = xq
    xq = buffer[:, :k]                                               # row stride k + 32, as a slice of rows
    w = fp8.quantize_weight((torch.randn(n, k) * 0.05).to(torch.bfloat16))
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    return xq, xs, w, b


def _written_out(xq, xs, w, b):
    """y = s_x s_w (x_fp8 @ w_fp8^T) + bias, in fp64."""
    y = (xq.double() @ w.weight.double().t()) * xs.double() * w.scale.double()
    return y if b is None else y + b.double()


def test_the_split_fills_the_sms_and_keeps_runs_long():
    assert sg.choose_split(96, 16, 132, 2) == 3                      # llama3-8b qkv: 96 x 3 = 288 programs
    assert sg.choose_split(448, 16, 132, 2) == 1                     # gate_up: 448 tiles already
    assert sg.choose_split(64, 56, 132, 2) == 5                      # down (K 14336)
    assert sg.choose_split(64, 4, 132, 2) == 1                       # a short K: one run
    assert sg.choose_split(1, 1024, 10_000, 2) == sg.MAX_SPLIT


def test_off_cuda_and_for_many_rows_the_caller_keeps_cublas():
    xq, xs, w, b = _operands(3, 128, 256, False)
    assert sg.scaled_mm_few_rows(xq, xs, w, b, torch.bfloat16) is None          # CPU: no Triton kernels
    big = torch.zeros(sg.MAX_ROWS + 1, 256, dtype=fp8.FP8)
    assert sg.scaled_mm_few_rows(big, torch.ones(sg.MAX_ROWS + 1, 1), w, b, torch.bfloat16) is None


def _triton_interpreted_checks():
    kern = sg._build()
    assert type(kern["gemm"]).__name__ == "InterpretedFunction", type(kern["gemm"])
    cases = [(1, 128, 512, False, 1), (5, 64, 1024, True, 2), (16, 192, 512, True, 1), (37, 128, 768, False, 2),
             (64, 64, 512, True, 1), (random.randint(1, 64), 128, 1024, random.random() < 0.5, 2)]
    for m, n, k, bias, waves in cases:
        xq, xs, w, b = _operands(m, n, k, bias)
        want = _written_out(xq, xs, w, b)
        for block_n, block_k in ((64, 128), (32, 256)):
            out = sg._launch(kern, xq, xs, w.weight, w.scale, b, torch.float32, block_n=block_n, block_k=block_k,
                             stages=2, waves=waves)
            assert out is not None and out.shape == (m, n) and out.dtype == torch.float32
            # fp32 sums of exact FP8 products, in another order than fp64's
            torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
            assert out.abs().max() > 1e-2                               # not all zeros
        bf16 = sg._launch(kern, xq, xs, w.weight, w.scale, b, torch.bfloat16, block_n=64, block_k=128, stages=2,
                          waves=waves)
        cublas = torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.scale, bias=b, out_dtype=torch.bfloat16)
        torch.testing.assert_close(bf16.float(), cublas.float(), atol=1e-2, rtol=1e-2)   # one bf16 rounding apart
    # the splits really split: 4 K tiles of 128 with 8 SMs' worth of programs wanted -> 4 runs of one tile
    assert sg.choose_split(1, 4, 4, 2) == 1                             # MIN_K_TILES keeps them whole ...
    xq, xs, w, b = _operands(3, 64, 2048, False)
    out = sg._launch(kern, xq, xs, w.weight, w.scale, b, torch.float32, block_n=64, block_k=128, stages=2, waves=8)
    torch.testing.assert_close(out.double(), _written_out(xq, xs, w, b), atol=1e-4, rtol=1e-4)   # ... 16 tiles: 4 runs
    # shapes it does not take: N or K off the blocks, a non-contiguous K
    xq, xs, w, b = _operands(2, 96, 512, False)
    assert sg._launch(kern, xq, xs, w.weight, w.scale, b, torch.float32, block_n=64) is None


def test_few_rows_gemm_interpreted():
    run_interpreted("test_fp8_small_gemm")


@pytest.mark.parametrize("m", [1, 16])
def test_fp8_linear_off_cuda_still_runs_scaled_mm(m):
    xq, xs, w, b = _operands(m, 128, 256, True)
    out = fp8.linear(fp8.Fp8Rows(xq, xs, torch.bfloat16), w, b)
    want = torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.scale, bias=b, out_dtype=torch.bfloat16)
    assert torch.equal(out, want)

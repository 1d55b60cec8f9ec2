"""kernels/fp8.py on CPU (torch._scaled_mm runs there too): weights quantized per output channel and
activations per token, one scaled GEMM, against the same arithmetic written out in fp32 and against
the bf16 layer; a model with FP8 linears against transformers; --quantization refused where it cannot run."""
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hf_reference import dense_causal_attend
from burstserve.kernels import fp8


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()


def test_weights_quantize_per_output_channel_within_fp8_precision():
    w = torch.randn(96, 256) * torch.rand(96, 1) * 3          # rows of very different sizes
    q = fp8.quantize_weight(w.to(torch.bfloat16))
    assert q.weight.dtype == fp8.FP8 and q.weight.shape == (96, 256) and q.scale.shape == (1, 96)
    assert torch.allclose(q.weight.float().abs().amax(dim=1), torch.full((96,), fp8.FP8_MAX))   # each row uses the range
    back = _dequantized(q.weight, q.scale.t())
    row_max = w.abs().amax(dim=1, keepdim=True)
    assert ((back - w).abs() <= w.abs() / 16 + row_max / 2**9 + 1e-2 * row_max / 64).all()     # 3 mantissa bits


def test_activations_quantize_per_token_with_the_exact_inverse_scale():
    x = (torch.randn(33, 128) * torch.rand(33, 1) * 10).to(torch.bfloat16)
    x[5] = 0                                                   # an all-zero token stays zero
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == fp8.FP8 and scale.shape == (33, 1) and scale.dtype == torch.float32
    assert not torch.isnan(q.float()).any() and (q.float().abs() <= fp8.FP8_MAX).all()
    back = _dequantized(q, scale)
    assert (back[5] == 0).all()
    row_max = x.float().abs().amax(dim=1, keepdim=True)
    assert ((back - x.float()).abs() <= x.float().abs() / 15 + row_max / 2**8).all()


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_the_scaled_product_of_its_quantized_operands(bias):
    m, k, n = random.choice([1, 7, 64]), 256, 192
    x = torch.randn(2, m, k).to(torch.bfloat16)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    qw = fp8.quantize_weight(w)
    out = fp8.linear(x, qw, b)                                  # [2, m, n]
    assert out.shape == (2, m, n) and out.dtype == torch.bfloat16
    qx, sx = fp8.quantize_rows(x.reshape(-1, k))
    written_out = _dequantized(qx, sx) @ _dequantized(qw.weight, qw.scale.t()).t()
    if bias:
        written_out = written_out + b.float()
    assert torch.allclose(out.reshape(-1, n).float(), written_out, rtol=1e-2, atol=1e-2)   # bf16 out
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    rel = (out.float() - exact).norm() / exact.norm()
    assert 1e-3 < rel < 0.06, rel                               # quantized (not bf16), and close to it
    assert torch.equal(fp8.linear(x, w, b), F.linear(x, w, b))  # a bf16 weight: plain F.linear


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hf_reference import save_checkpoint
    path = str(tmp_path_factory.mktemp("llama3-gqa-fp8"))
    return path, save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))


@torch.no_grad()
def test_a_model_with_fp8_linears_stays_close_to_transformers(checkpoint):
    """The tiny GQA model (hidden 64: few terms per dot product, so a coarse bound) in bf16 and with FP8
    linears, against transformers in fp32 over 96 positions: FP8 is further off than bf16 but close."""
    from burstserve.engine.model.config import load_model_config
    from burstserve.engine.model.model import LlamaModel
    path, hf = checkpoint
    cfg = load_model_config(path)
    ids = torch.randint(0, cfg.vocab_size, (96,))
    ref = hf(ids[None]).logits[0].float()
    centered = (ref - ref.mean(-1, keepdim=True)).norm()
    errors = {}
    for quantization in ("none", "fp8"):
        weights = {name: t.to(torch.bfloat16) for name, t in hf.state_dict().items()}
        model = LlamaModel(cfg, weights, torch.device("cpu"), quantization=quantization)
        logits = model.logits(model.forward(ids, torch.arange(96), dense_causal_attend))
        errors[quantization] = ((logits - ref).norm() / centered).item()
        if quantization == "none":                              # (random weights: flat logits, so FP8's
            assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9   # top-1 is not a fair test)
    assert isinstance(model.layers[0].gate_up, fp8.Fp8Weight) and model.layers[0].gate_up.weight.dtype == fp8.FP8
    assert errors["none"] < 0.03 and 2 * errors["none"] < errors["fp8"] < 0.2, errors
    print(f"fp8 model: logits' relative error against transformers fp32 {errors['fp8']:.4f} (bf16: {errors['none']:.4f})")


def test_fp8_is_refused_without_cuda_and_an_unknown_quantization_by_name():
    from burstserve.engine import LLM
    from burstserve.engine.core.errors import DeviceSpecError, InvalidRequestError
    with pytest.raises(DeviceSpecError, match="CUDA GPUs with FP8 tensor cores"):
        LLM("tiny", devices="cpu", quantization="fp8")
    with pytest.raises(InvalidRequestError, match="not one of none, fp8"):
        LLM("tiny", devices="cpu", quantization="int4")
    proc = subprocess.run([sys.executable, "-m", "burstserve.server.cli", "serve", "--model", "tiny", "--devices", "cpu",
                           "--quantization", "fp8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs CUDA GPUs with FP8 tensor cores" in proc.stderr, proc.stderr[-2000:]

"""A prefill's MLP runs MLP_PIECE_ROWS rows at a time (engine/model/model.py, LlamaModel.mlp), so the KV pool is
sized for one piece of its intermediates (engine/pages/sizing.py). With pieces of a few rows the model's
logits equal transformers' (fp32) and the unpieced model's, in bf16 and with FP8 linears (rows quantized per
token either way).

The CPU's scaled GEMM (oneDNN) rounds a row differently with the number of rows beside it; in bf16 with FP8
linears one such rounding, requantized by the next layer, grew to 0.09 in the logits (CI, 2026-11-28). The FP8
case therefore runs its GEMMs in float64, where a row's result does not depend on its neighbours, so that the
test judges the piecing alone."""
import random

import pytest
import torch

import burstserve.engine.model.model
from burstserve.engine.model.config import load_model_config
from burstserve.engine.model.model import LlamaModel
from burstserve.kernels import fp8
from hf_reference import dense_causal_attend


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hf_reference import save_checkpoint
    path = str(tmp_path_factory.mktemp("llama3-gqa-mlp"))
    return path, save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))


def rowwise_scaled_mm(xq, xs, w, bias, dtype):
    """fp8.scaled_mm in float64: xq [M, K] fp8, xs [M, 1], w.weight [N, K] fp8, w.scale [1, N] -> [M, N]."""
    y = (xq.double() * xs.double()) @ (w.weight.double() * w.scale.double().t()).t()
    return (y if bias is None else y + bias.double()).to(dtype)


@torch.no_grad()
@pytest.mark.parametrize("dtype, quantization", [(torch.float32, "none"), (torch.bfloat16, "fp8")])
def test_the_mlp_in_row_pieces_gives_the_same_logits(checkpoint, monkeypatch, dtype, quantization):
    path, hf = checkpoint
    cfg = load_model_config(path)
    n = random.randrange(40, 90)
    ids = torch.randint(0, cfg.vocab_size, (n,))
    if quantization == "fp8":
        monkeypatch.setattr(fp8, "scaled_mm", rowwise_scaled_mm)
    logits = {}
    for piece in (1 << 20, random.choice([1, 7, 16])):
        monkeypatch.setattr(burstserve.engine.model.model, "MLP_PIECE_ROWS", piece)
        weights = {name: t.to(dtype) for name, t in hf.state_dict().items()}
        model = LlamaModel(cfg, weights, torch.device("cpu"), quantization=quantization)
        logits[piece > n] = model.logits(model.forward(ids, torch.arange(n), dense_causal_attend))
    whole, pieces = logits[True], logits[False]
    assert torch.allclose(pieces, whole, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2), \
        (pieces - whole).abs().max()
    if quantization == "none":
        ref = hf(ids[None]).logits[0].float()
        assert torch.allclose(pieces, ref, rtol=1e-4, atol=1e-4), (pieces - ref).abs().max()

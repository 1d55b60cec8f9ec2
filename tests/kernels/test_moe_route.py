"""kernels/moe_route.py: the router's softmax, top k and renormalization in one kernel, run by Triton's interpreter on
the CPU against the torch ops (transformers' arithmetic: the same weights; the experts of a stable sort) on fresh
random logits, with ties at the k-th place, rows
that are not a multiple of the kernel's and expert counts that are not a power of 2."""
import random

import torch

from burstserve.kernels import moe_route as mr
from triton_interpreter import run_interpreted


def _check(kern, rows: int, experts: int, k: int, renormalize: bool, dtype: torch.dtype, out_dtype: torch.dtype):
    logits = (torch.randn(rows, experts) * 3).to(dtype)
    got_w, got_i = mr._route_triton(kern["route"], logits, k, renormalize, out_dtype)
    want_w, _ = mr.route_torch(logits, k, renormalize, out_dtype)
    probs = torch.softmax(logits.float(), dim=-1)           # equal probs (bf16 logits tie often): lower index first
    want_i = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    assert got_i.dtype == torch.int64 and got_w.dtype == out_dtype
    assert torch.equal(got_i, want_i), (got_i, want_i)
    torch.testing.assert_close(got_w.float(), want_w.float(), atol=2e-7 if out_dtype == torch.float32 else 0,
                               rtol=1e-6 if out_dtype == torch.float32 else 2 ** -8)


def _ties(kern):
    """Logits tied across the k-th place: the lower experts are chosen, largest first, and the weights are the
    torch ops' (which on the CPU may pick others of the same value)."""
    k, experts = 4, 12
    logits = torch.zeros(3, experts)
    logits[:, [2, 9]] = 5.0                                   # two clear winners
    logits[:, [1, 4, 7, 10]] = 3.0                            # four tied for the last two places
    w, i = mr._route_triton(kern["route"], logits, k, True, torch.float32)
    assert i.tolist() == [[2, 9, 1, 4]] * 3, i
    want_w, _ = mr.route_torch(logits, k, True, torch.float32)
    torch.testing.assert_close(w, want_w)


def _triton_interpreted_checks():
    kern = mr._build()
    assert type(kern["route"]).__name__ == "InterpretedFunction", type(kern["route"])
    _check(kern, 1, 128, 8, True, torch.bfloat16, torch.bfloat16)          # Qwen3-30B-A3B's decode row
    _check(kern, 7, 8, 2, True, torch.float32, torch.float32)              # Mixtral: fp32 weights
    _check(kern, 5, 60, 4, False, torch.float32, torch.float32)            # Qwen2-MoE: 60 experts, no renormalization
    _check(kern, random.randint(1, 40), random.randint(2, 300), random.randint(1, 2), random.random() < 0.5,
           torch.float32, torch.float32)
    _ties(kern)


def test_the_kernel_interpreted():
    run_interpreted("test_moe_route")


def test_the_torch_ops_are_transformers_router():
    """route_torch against transformers' Qwen3-MoE router arithmetic, written out (softmax fp32, topk, renormalize)."""
    logits = torch.randn(9, 64).to(torch.bfloat16)
    probs = torch.nn.functional.softmax(logits, dim=1, dtype=torch.float)
    want_w, want_i = torch.topk(probs, 8, dim=-1)
    want_w = (want_w / want_w.sum(dim=-1, keepdim=True)).to(torch.bfloat16)
    w, i = mr.route_torch(logits, 8, True, torch.bfloat16)
    assert torch.equal(i, want_i) and torch.equal(w, want_w)

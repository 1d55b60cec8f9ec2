"""kernels/moe_few_rows.py: the few-rows experts' MLP, run by Triton's interpreter on the CPU, equals engine/model/moe.py's
routed experts (fp32) for random experts, routings and row counts, by expert and by choice slot, with every row on
one expert and an expert on one row; the experts no row chose are never read into an output (NaN weights there);
the block chooser fills the SMs; shapes it does not take go back to the caller. FP8 experts (--quantization fp8):
the kernels against the same arithmetic written out in fp64 (x and each silu*up row quantized per row, FP8
products, both scales) and against engine/model/moe.py's CPU path (per-expert kernels/fp8.linear)."""
import random

import torch
import torch.nn.functional as F

from burstserve.engine.model.moe import ExpertWeights, quantize_experts, routed_experts
from burstserve.kernels import fp8
from burstserve.kernels import moe_few_rows as mf
from triton_interpreter import run_interpreted


def _experts(e: int, hidden: int, im: int, k: int) -> ExpertWeights:
    """Random experts in fp32, their weights scaled to keep each product near 1."""
    return ExpertWeights(router=torch.zeros(e, hidden), gate_up=torch.randn(e, 2 * im, hidden) / hidden ** 0.5,
                         down=torch.randn(e, hidden, im) / im ** 0.5, top_k=k, renormalize=True, weights_fp32=True)


def _routing(m: int, e: int, k: int, everyone_on: int | None = None, alone_on: int | None = None):
    """(weights [m, k] fp32, chosen [m, k] int64): each row's k distinct experts from random scores; everyone_on:
    an expert every row chooses; alone_on: an expert only the last row chooses."""
    scores = torch.rand(m, e)
    if everyone_on is not None:
        scores[:, everyone_on] = 2.0
    if alone_on is not None:
        scores[:, alone_on] = -1.0
        scores[-1, alone_on] = 3.0
    chosen = torch.topk(scores, k, dim=-1).indices
    weights = torch.softmax(torch.randn(m, k), dim=-1)
    return weights, chosen


def _check(kern, m, e, k, hidden, im, everyone_on=None, alone_on=None, **launch):
    experts = _experts(e, hidden, im, k)
    x = torch.randn(m, hidden)
    weights, chosen = _routing(m, e, k, everyone_on, alone_on)
    unchosen = torch.ones(e, dtype=torch.bool)
    unchosen[chosen.flatten()] = False
    experts.gate_up[unchosen] = float("nan")                  # an expert no row chose: never in an output
    experts.down[unchosen] = float("nan")
    want = routed_experts(x, experts, weights, chosen)
    scale = want.abs().max().item()
    assert torch.isfinite(want).all() and scale > 1e-2

    out = mf._launch(kern, x, experts.gate_up, experts.down, weights, chosen, **launch)
    assert out is not None and out.shape == (m, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=1e-4 * scale, rtol=1e-4)       # fp32 sums in another order

    # bf16 operands against the fp32 sum of the same (rounded) values: silu * up and the output rounded to bf16
    xb, gub, db = x.bfloat16(), experts.gate_up.bfloat16(), experts.down.bfloat16()
    rounded = ExpertWeights(experts.router, gub.float(), db.float(), k, True, True)
    for w in (weights, weights.bfloat16()):
        want16 = routed_experts(xb.float(), rounded, w.float(), chosen)
        out16 = mf._launch(kern, xb, gub, db, w, chosen, **launch)
        assert out16 is not None and out16.dtype == torch.bfloat16
        torch.testing.assert_close(out16.float(), want16, atol=1e-2 * scale, rtol=1e-2)


def fp8_gate_up_reference(x, gate_up, chosen) -> torch.Tensor:
    """The FP8 gate_up kernel's arithmetic in fp64 (gate_up: engine/moe.Fp8Experts) -> act [M, k, Im] in x's dtype:
    x quantized per row, each choice's gate and up the scaled sums of FP8 products, silu(gate) * up rounded."""
    xq, xs = fp8.quantize_rows(x)
    xd = xq.double() * xs.double()                                              # [M, hidden]
    gu = gate_up.weight.double() * gate_up.scale.double()[..., None]           # [E, 2 Im, hidden]
    im = gu.shape[1] // 2
    h = torch.einsum("mc,mjnc->mjn", xd, gu[chosen])                           # [M, k, 2 Im]
    return (F.silu(h[..., :im]) * h[..., im:]).float().to(x.dtype)


def fp8_down_reference(act, down, weights, chosen) -> torch.Tensor:
    """The FP8 down kernel's and the sum's arithmetic in fp64 -> [M, hidden]: each choice's silu*up row act [M, k, Im]
    quantized per row, its down product times the routing weight, the k choices summed."""
    m, k, im = act.shape
    aq, a_scale = fp8.quantize_rows(act.reshape(m * k, im))
    ad = (aq.double() * a_scale.double()).view(m, k, im)
    dn = down.weight.double() * down.scale.double()[..., None]                 # [E, hidden, Im]
    y = torch.einsum("mji,mjhi->mjh", ad, dn[chosen]) * weights.double()[..., None]   # [M, k, hidden]
    return y.sum(dim=1)


def _launch_seen(kern, x, gu, dn, weights, chosen, **launch):
    """mf._launch's output and the silu*up rows its gate_up kernel made ([M, k, Im], as the down kernel's
    quantization read them): the reference of the down kernel starts from the same rows, so that an FP8 rounding
    of silu*up that fp32 and fp64 sums straddle does not count against it."""
    seen = []

    def quantize_rows(rows):
        seen.append(rows.clone())
        return fp8.quantize_rows(rows)

    saved, mf.quantize_rows = mf.quantize_rows, quantize_rows
    try:
        out = mf._launch(kern, x, gu.weight, dn.weight, weights, chosen, gu.scale, dn.scale, **launch)
    finally:
        mf.quantize_rows = saved
    assert out is None or (len(seen) == 2 and torch.equal(seen[0], x))
    return out, (seen[1].view(*chosen.shape, -1) if out is not None else None)


def _check_fp8(kern, m, e, k, hidden, im, everyone_on=None, **launch):
    experts = _experts(e, hidden, im, k)
    weights, chosen = _routing(m, e, k, everyone_on)
    quantized = ExpertWeights(experts.router, quantize_experts(list(experts.gate_up)),
                              quantize_experts(list(experts.down)), k, True, True)
    gu, dn = quantized.gate_up, quantized.down
    unchosen = torch.ones(e, dtype=torch.bool)
    unchosen[chosen.flatten()] = False
    for q in (gu, dn):                                         # an expert no row chose: never in an output
        q.weight.view(torch.uint8)[unchosen] = 0x7F            # e4m3fn's NaN
        q.scale[unchosen] = float("nan")
    x = torch.randn(m, hidden)
    for rows, w in ((x, weights), (x.bfloat16(), weights.bfloat16())):
        out, act = _launch_seen(kern, rows, gu, dn, w, chosen, **launch)
        assert out is not None and out.shape == (m, hidden) and out.dtype == rows.dtype
        want_act = fp8_gate_up_reference(rows, gu, chosen)
        want = fp8_down_reference(act, dn, w, chosen)
        scale = want.abs().max().item()
        assert torch.isfinite(want).all() and scale > 1e-2
        if rows.dtype == torch.float32:     # fp32 sums of exact FP8 products, in another order than fp64's
            torch.testing.assert_close(act.double(), want_act.double(), atol=1e-5 * want_act.abs().max().item(),
                                       rtol=1e-5)
            torch.testing.assert_close(out.double(), want, atol=1e-5 * scale, rtol=1e-5)
        else:   # silu*up one bf16 rounding apart at most, but for an up that cancels to ~0 (fp32 sums in another
                # order than fp64's: 0 against 9e-17 was seen), hence the small atol
            torch.testing.assert_close(act.double(), want_act.double(), atol=1e-5 * want_act.abs().max().item(),
                                       rtol=2 ** -7)
            torch.testing.assert_close(out.double(), want, atol=1e-2 * scale, rtol=1e-2)

    # the CPU's path (per-expert fp8.linear) quantizes at the same points: apart by fp32 sums in other orders, and
    # where those straddle an FP8 rounding of silu*up, by one step of one element of one row (in about one case in
    # ten here: a few percent of that row); the unquantized experts 3-10% away (e4m3's rounding of x, the weights
    # and silu*up, on these small dot products)
    out, _ = _launch_seen(kern, x, gu, dn, weights, chosen, **launch)
    cpu_path = routed_experts(x, quantized, weights, chosen)
    row_err = (out - cpu_path).norm(dim=1) / cpu_path.norm(dim=1)              # [M]
    assert (row_err > 1e-4).sum() <= 2 and row_err.max() < 0.1, row_err
    exact = routed_experts(x, experts, weights, chosen)
    assert 0.02 < (out - exact).norm() / exact.norm() < 0.15


def _fp8_interpreted_checks(kern):
    rows = random.randint(2, 64)
    cases = [  # m, experts, k, hidden, Im, launch
        (1, 8, 2, 64, 32, dict(block_k=32)),                           # by slot
        (3, 4, 4, 64, 64, dict(block_n=16, block_k=32)),               # every row on every expert
        (37, 8, 2, 64, 32, dict(block_n=32)),                          # by expert, K tiles of 64 and 32
        (64, 16, 4, 32, 32, dict(block_n=16)),                         # all 64 rows
        (rows, random.choice([4, 8, 16]), random.choice([1, 2]), 128, 64, dict(block_k=64)),
    ]
    for m, e, k, hidden, im, launch in cases:
        _check_fp8(kern, m, e, k, hidden, im, **launch)
    _check_fp8(kern, 5, 16, 2, 64, 32, everyone_on=3)                # by slot, every row's first slot on expert 3
    # FP8's MMA takes K in steps of 32: Im 48 (16-wide K tiles only) goes back to the caller
    ex = _experts(4, 64, 48, 2)
    w, ch = _routing(2, 4, 2)
    gu, dn = quantize_experts(list(ex.gate_up)), quantize_experts(list(ex.down))
    assert mf._launch(kern, torch.randn(2, 64), gu.weight, dn.weight, w, ch, gu.scale, dn.scale) is None
    ex = _experts(4, 64, 32, 2)
    gu, dn = quantize_experts(list(ex.gate_up)), quantize_experts(list(ex.down))
    assert mf._launch(kern, torch.randn(2, 64), gu.weight, dn.weight, w, ch, gu.scale[:, :8], dn.scale) is None
    assert mf._launch(kern, torch.randn(2, 64), gu.weight, ex.down, w, ch, gu.scale, dn.scale) is None


def _triton_interpreted_checks():
    kern = mf._build()
    assert type(kern["gate_up"]).__name__ == "InterpretedFunction", type(kern["gate_up"])
    rows = random.randint(2, 64)
    cases = [  # m, experts, k, hidden, Im, launch
        (1, 8, 2, 64, 32, dict(block_k=32)),                           # by slot: two programs' experts
        (1, 16, 1, 32, 16, dict()),                                    # one row, one choice
        (3, 4, 4, 32, 32, dict(block_n=16, block_k=16)),               # every row on every expert
        (3, 16, 2, 64, 48, dict(block_k=16)),                          # Im 48: 16-wide blocks only
        (37, 8, 2, 32, 32, dict(block_n=32, block_k=32)),              # by expert
        (64, 16, 4, 32, 32, dict(block_n=16, block_k=32)),             # all 64 rows
        (rows, random.choice([4, 8, 16]), random.choice([1, 2]), 64, 32, dict(block_k=32)),
    ]
    for m, e, k, hidden, im, launch in cases:
        _check(kern, m, e, k, hidden, im, **launch)
    _check(kern, 5, 16, 2, 32, 32, everyone_on=3, block_k=16)          # by slot, every row's first slot on expert 3
    _check(kern, 20, 8, 2, 32, 32, everyone_on=0, block_n=16)          # by expert, expert 0 on every row
    _check(kern, 6, 16, 2, 32, 16, alone_on=11, block_k=16)            # expert 11 on the last row alone
    _check(kern, 9, 4, 2, 32, 16, alone_on=2, block_k=16)

    # shapes the kernels do not take: more rows than MAX_ROWS, Im off 16, mixed dtypes
    ex = _experts(4, 32, 32, 2)
    w, ch = _routing(mf.MAX_ROWS + 1, 4, 2)
    assert mf._launch(kern, torch.randn(mf.MAX_ROWS + 1, 32), ex.gate_up, ex.down, w, ch) is None
    w, ch = _routing(2, 4, 2)
    odd = _experts(4, 32, 24, 2)
    assert mf._launch(kern, torch.randn(2, 32), odd.gate_up, odd.down, w, ch) is None
    assert mf._launch(kern, torch.randn(2, 32).bfloat16(), ex.gate_up, ex.down, w, ch) is None
    _fp8_interpreted_checks(kern)


def test_few_rows_experts_interpreted():
    run_interpreted("test_moe_few_rows")


def test_the_blocks_fill_the_sms():
    assert mf.choose_block_n(8, 768, 132, 2) == 16          # qwen3-30b-a3b gate_up, one row: 8 x 48 = 384 programs
    assert mf.choose_block_n(8, 2048, 132, 2) == 32         # its down: 8 x 64 = 512
    assert mf.choose_block_n(128, 768, 132, 2) == 64        # 64 rows: every expert a candidate
    assert mf.choose_block_n(2, 14336, 132, 2) == 64        # mixtral gate_up, one row: 2 x 224 = 448
    assert mf.choose_block_n(2, 4096, 132, 2) == 16         # its down: 2 x 256 = 512
    assert mf.choose_block_n(1, 48, 132, 2) == 16           # too few either way: the narrowest that divides
    assert mf.choose_block_n(4, 40, 132, 2) is None
    assert mf.fit_block_k(768, 128) == 128 and mf.fit_block_k(1408, 256) == 128 and mf.fit_block_k(48, 128) == 16
    assert mf.fit_block_k(40, 128) is None


def test_off_cuda_and_for_many_rows_the_caller_keeps_its_path():
    experts = _experts(8, 32, 32, 2)
    weights, chosen = _routing(3, 8, 2)
    assert mf.experts_few_rows(torch.randn(3, 32), experts.gate_up, experts.down, weights, chosen) is None   # CPU
    weights, chosen = _routing(mf.MAX_ROWS + 1, 8, 2)
    x = torch.randn(mf.MAX_ROWS + 1, 32)
    assert mf.experts_few_rows(x, experts.gate_up, experts.down, weights, chosen) is None

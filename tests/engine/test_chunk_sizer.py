"""engine/scheduler/chunk_sizer.py: the chunk of a long prompt sized to an inter-token-latency target from a cost
model fitted to the engine's own prefill times (synthetic times here, drawn fresh each run)."""
import random

import pytest

from burstserve.engine.model.config import preset_config
from burstserve.engine.scheduler.chunk_sizer import MIN_CHUNK, ChunkSizer, attention_flop_ratio


def _cost(t0, a, b, n, c):
    return t0 + a * n + b * n * (c + n / 2)


def _trained(t0, a, b, ratio=3e-5, max_tokens=16384, target=0.05, align=128):
    sizer = ChunkSizer(max_tokens, target, ratio, align)
    for _ in range(40):
        n, c = random.choice([512, 1024, 2048, 4096, 8192]), random.randrange(0, 200_000)
        sizer.observe(n, c, _cost(t0, a, b, n, c) * random.uniform(0.998, 1.002))   # timing noise
    return sizer


def test_the_fit_recovers_the_cost_model():
    t0, a, b = random.uniform(2e-3, 5e-3), random.uniform(2e-5, 4e-5), random.uniform(5e-10, 2e-9)
    fitted = _trained(t0, a, b).coefficients()
    for got, want in zip(fitted[1:], (a, b)):
        assert abs(got - want) / want < 0.05, (fitted, (t0, a, b))
    assert abs(fitted[0] - t0) < 2e-3


def test_a_call_far_slower_than_the_rest_is_left_out_of_the_fit():
    """One call 11x slower than its cost (a kernel built on its first use: 3.0 s where 0.27 s was usual,
    one H200) among 40: the fit predicts as if it had not happened."""
    t0, a, b = 5e-3, 3e-5, 4e-10
    clean = _trained(t0, a, b)
    sizer = ChunkSizer(16384, 0.05, 3e-5, 128)
    calls = list(clean.calls)
    slow = random.randrange(len(calls))
    for i, (n, c, seconds) in enumerate(calls):
        sizer.observe(n, c, seconds * (11 if i == slow else 1))
    for n, context in ((8192, 16384), (1024, 65536), (256, 131072)):
        want = _cost(t0, a, b, n, context)
        assert abs(sizer.predict(n, context) - want) / want < 0.05, (n, context)


def test_busy_chunks_fit_the_target_and_shrink_as_the_context_grows():
    t0, a, b = 3e-3, 3e-5, 1e-9
    sizer = _trained(t0, a, b)
    step = 0.007
    sizes = []
    for context in (0, 32768, 65536, 131072, 500_000):
        n = sizer.size(context, 10**6, busy=True, step_seconds=step)
        sizes.append(n)
        assert n % 128 == 0 and MIN_CHUNK <= n <= 16384
        if n > MIN_CHUNK:
            assert _cost(t0, a, b, n, context) + step <= 0.05 * 1.03, (context, n)
            assert _cost(t0, a, b, n + 256, context) + step > 0.05 * 0.97, (context, n)  # not far below it
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1], sizes
    assert sizes[-1] == MIN_CHUNK                     # the floor, even when the target cannot be met


def test_alone_or_without_a_target_or_a_measurement_a_chunk_is_the_largest():
    sizer = _trained(3e-3, 3e-5, 1e-9)
    assert sizer.size(131072, 10**6, busy=False) == 16384
    assert sizer.size(131072, 1000, busy=False) == 1000                       # never past the prompt
    assert ChunkSizer(16384, None, 3e-5).size(0, 10**6, busy=True) == 16384
    assert ChunkSizer(16384, 0.05, 3e-5).size(0, 10**6, busy=True) == 16384  # nothing measured yet
    small = ChunkSizer(64, 0.05, 3e-5)                                          # max below the floor: max
    small.observe(64, 0, 1.0)
    assert small.size(0, 10**6, busy=True) == 64


def test_before_contexts_spread_the_attention_term_comes_from_the_flop_ratio():
    """Calls at one context only (a prompt's first chunks): b = a * the model's FLOP ratio."""
    ratio = attention_flop_ratio(preset_config("llama3-8b"))
    sizer = ChunkSizer(8192, 0.05, ratio, 128)
    a = random.uniform(2e-5, 4e-5)
    for n in (8192, 8192):
        sizer.observe(n, 0, a * (n + ratio * n * n / 2))
    t0, a_fit, b_fit = sizer.coefficients()
    assert abs(a_fit - a) / a < 1e-6 and abs(b_fit - a * ratio) / (a * ratio) < 1e-6 and t0 == 0.0
    # 128K cached: attention per query is ratio * 131072 = 4.9 GEMM tokens' worth, so chunks shrink ~6x
    assert sizer.size(131072, 10**6, busy=True) < sizer.size(0, 10**6, busy=True) / 4


def test_flop_ratio_of_llama3_8b():
    """4 * 4096 / (2 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336)) = 3.756e-5."""
    assert attention_flop_ratio(preset_config("llama3-8b")) == pytest.approx(16384 / (2 * 218_103_808))

"""How many tokens a long prompt's next chunk prefills (chunked prefill, --max-num-batched-tokens).

Alone (nothing decoding, nothing waiting) a chunk is the largest allowed: nobody waits on it, and large
chunks keep the prompt's own time to first token near an unchunked prefill's. While other sequences
decode, a decode step runs between chunks, so their inter-token latency is one chunk plus one step: the
chunk is sized so that sum stays within --itl-target-ms. A chunk's cost grows with the context already
prefilled (its queries attend to all of it), so a fixed chunk that is cheap at the start of a 128K prompt
stalls the streams near its end; Medha (arXiv 2409.17264) sizes chunks to a time budget per step for
this reason.

The cost model, per call, in seconds, for n new tokens after c cached ones:

    t(n, c) = t0 + a * n + b * n * (c + n / 2)

t0 the per-call overhead (weights are read once per call), a the per-token cost of the GEMMs, b the
per-(query, key) cost of attention (n * c keys cached, n^2 / 2 causal among the new). It is fitted by
least squares (non-negative) to the engine's own recent prefill and extend calls. Until those calls span
contexts far enough apart to separate a from b, b is taken from a * the model's FLOP ratio (attention
FLOPs per query-key pair over GEMM FLOPs per token), so the first chunks are sized sensibly too.
"""
import math
from collections import deque

import torch

from burstserve.engine.model.config import MIN_CHUNK, MIN_CHUNK_CPU, ModelConfig

HISTORY = 48             # calls the model is fitted to (the latest: the GPU's clocks and kernels drift)
OUTLIER = 2.5            # a call this many times slower than the fit predicts is left out of it (a kernel
                         # built on first use takes ten times a usual call, and the next chunks would be
                         # sized from it)


def min_chunk_tokens(device_type: str) -> int:
    """The smallest chunk on this kind of device (MIN_CHUNK on GPUs, MIN_CHUNK_CPU on CPU)."""
    return MIN_CHUNK if device_type == "cuda" else MIN_CHUNK_CPU


def attention_flop_ratio(cfg: ModelConfig) -> float:
    """Attention FLOPs per query-key pair / GEMM FLOPs per token, over all layers: 4 H D per pair
    (QK^T and PV) against 2 per weight."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    weights_per_layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    return 4 * q / (2 * weights_per_layer)


class ChunkSizer:
    def __init__(self, max_tokens: int, itl_target_s: float | None, flop_ratio: float, align: int = 1,
                 min_tokens: int = MIN_CHUNK):
        """max_tokens: the largest chunk (--max-num-batched-tokens); itl_target_s: None sizes every chunk
        max_tokens; align: chunk sizes are multiples of it when they can be (the KV page size); min_tokens:
        the smallest chunk, even when the target cannot be met (the prompt must progress)."""
        self.max_tokens, self.itl_target_s, self.flop_ratio = max_tokens, itl_target_s, flop_ratio
        self.align = align
        self.min_tokens = min(max_tokens, min_tokens)
        self.calls: deque[tuple[int, int, float]] = deque(maxlen=HISTORY)   # (n, c, seconds)
        self._coefficients: tuple[float, float, float] | None = None

    def observe(self, new_tokens: int, context: int, seconds: float) -> None:
        """A prefill (context 0) or extend call of new_tokens after `context` cached ones took `seconds`."""
        if new_tokens > 0 and seconds > 0:
            self.calls.append((new_tokens, context, seconds))
            self._coefficients = None

    def size(self, context: int, remaining: int, busy: bool, step_seconds: float = 0.0) -> int:
        """The next chunk of a prompt with `context` tokens prefilled and `remaining` to go. busy: other
        sequences decode or wait, so the chunk plus one of their steps (step_seconds) should fit the target."""
        if not busy or self.itl_target_s is None or not self.calls:
            return min(self.max_tokens, remaining)
        n = self.tokens_within(self.itl_target_s - step_seconds, context)
        if n >= self.align:
            n -= n % self.align
        return min(max(n, self.min_tokens), self.max_tokens, remaining)

    def predict(self, new_tokens: int, context: int) -> float:
        t0, a, b = self.coefficients()
        return t0 + a * new_tokens + b * new_tokens * (context + new_tokens / 2)

    def tokens_within(self, seconds: float, context: int) -> int:
        """The most new tokens after `context` whose predicted time is within `seconds`: the positive root
        of (b/2) n^2 + (a + b c) n + (t0 - seconds) = 0."""
        t0, a, b = self.coefficients()
        budget, linear = seconds - t0, a + b * context
        if budget <= 0:
            return 0
        if b <= 0:
            return int(budget / linear) if linear > 0 else self.max_tokens
        return int((-linear + math.sqrt(linear * linear + 2 * b * budget)) / b)

    def coefficients(self) -> tuple[float, float, float]:
        """(t0, a, b), fitted to the recent calls."""
        if self._coefficients is None:
            self._coefficients = self._fit()
        return self._coefficients

    def _fit(self) -> tuple[float, float, float]:
        """The fit to the recent calls, refitted without the ones far slower than it predicts (up to 3
        times: an outlier distorts the first fit)."""
        calls = list(self.calls)
        fitted = self._fit_calls(calls)
        for _ in range(3):
            t0, a, b = fitted
            kept = [(n, c, s) for n, c, s in calls if s <= OUTLIER * (t0 + a * n + b * n * (c + n / 2))]
            if len(kept) == len(calls) or len(kept) < 4:
                break
            calls = kept
            fitted = self._fit_calls(calls)
        return fitted

    def _fit_calls(self, calls: list[tuple[int, int, float]]) -> tuple[float, float, float]:
        n = torch.tensor([c[0] for c in calls], dtype=torch.float64)
        ctx = torch.tensor([c[1] for c in calls], dtype=torch.float64)
        t = torch.tensor([c[2] for c in calls], dtype=torch.float64)
        pairs = n * (ctx + n / 2)
        spread = (pairs / n).max() / (pairs / n).min().clamp(min=1.0)
        if len(calls) >= 4 and spread > 4:               # contexts far enough apart to tell a from b
            fitted = _nonnegative_fit([torch.ones_like(n), n, pairs], t)
            if fitted[1] > 0 and fitted[2] > 0:
                return fitted
        # one shape: t = t0 + a * (n + ratio * pairs); t0 only when the calls' sizes differ
        work = n + self.flop_ratio * pairs
        t0, a = _nonnegative_fit([torch.ones_like(n), work], t) if (n.max() > 2 * n.min()) else (0.0, 0.0)
        if a <= 0:
            t0, a = 0.0, float((t * work).sum() / (work * work).sum())
        return t0, a, a * self.flop_ratio


def _nonnegative_fit(columns: list[torch.Tensor], target: torch.Tensor) -> tuple[float, ...]:
    """Least squares with every coefficient >= 0: a column whose coefficient comes out negative is
    dropped (its coefficient 0) and the rest refitted."""
    keep = list(range(len(columns)))
    while keep:
        x = torch.stack([columns[i] for i in keep], dim=1)                  # [calls, kept]
        solution = torch.linalg.lstsq(x, target[:, None]).solution[:, 0]
        if (solution >= 0).all():
            out = [0.0] * len(columns)
            for i, value in zip(keep, solution.tolist()):
                out[i] = value
            return tuple(out)
        keep.pop(int(solution.argmin()))
    return tuple([0.0] * len(columns))

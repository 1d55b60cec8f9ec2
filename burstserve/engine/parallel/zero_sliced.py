"""burst-zero's short prompts on the weights as they lie: the MLP tensor-parallel, burst's K/V layout.

Why: a burst-zero prefill gathers every layer's whole MLP from the workers' tp slices, one layer ahead,
behind the previous layer's compute (engine/parallel/zero.py). A short prompt's layer computes in less
time than its gather takes, and then waits for it. Such a prompt runs instead as tensor parallelism runs
its MLP (the BurstAttention paper's other baseline, Megatron V1): every worker runs all N tokens through
its weights (the attention's whole, every head causal over all N tokens; its MLP slice, then the model's
all-reduce after down), no weight moved. The K/V cache stays burst's (worker r keeps its zigzag shard's
tokens, every K/V head), so decode and later extends are unchanged: every worker computed every K/V head,
and keeps its shard's rows.

Which prompts (ZeroLayout.sliced_limit, engine/parallel/zero.py; ModelRunner.sliced_max_tokens): those of
at most --zero-sliced-max-tokens tokens; unset, on GPUs, measured at start (`measure_sliced_max_tokens`):
a layer's gather takes G seconds, a row of the prompt Q seconds through the attention's projections and M
through the MLP's whole GEMMs, and A seconds in an all-reduce of hidden states. A gathered layer of N
tokens takes about max(G, N (Q + M) / W) (its gather behind the layer before), a sliced one
N (Q + M / W + A): sliced is faster while N < G / (Q + M / W + A). On CPU, unset: none (the tests set it).
Either way at most a worker's share of --max-model-len: the activation memory the KV pool's sizing leaves
is for that many rows (engine/pages/sizing.py), and a sliced row takes less than a whole one.
"""
import logging
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from burstserve.engine.core.placement import Shard
from burstserve.engine.model.moe import experts_mlp

log = logging.getLogger(__name__)
SLICED = "burst-zero-sliced"    # the prefill stats' strategy of such a prompt
PROBE_ROWS = 2048           # rows through a whole layer's GEMMs when measuring R


class SlicedPrefillAttention:
    """One prompt's attention, every worker running all of its tokens through its weights (see the module
    docstring): __call__(layer, q [N, H, D], k, v [N, Hkv, D]) -> out [N, H, D], causal, and this worker's
    shard's K/V, every head, written to its slots."""

    def __init__(self, pool, slots: torch.Tensor, shard: Shard, backend, scale: float):
        self.pool, self.slots, self.backend, self.scale = pool, slots, backend, scale
        self.rows = shard.positions().to(slots.device)                    # [n] the tokens this worker keeps

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, _ = self.backend(q, k, v, True, self.scale)                               # [N, H, D]
        self.pool.write(layer, self.slots, k.index_select(0, self.rows), v.index_select(0, self.rows))
        return out


@torch.inference_mode()
def measure_sliced_max_tokens(gather, world_size: int, device: torch.device, dtype: torch.dtype, group=None) -> int:
    """G / (Q + M / W + A) (module docstring), timed at start, best of 3 each (collective: every worker
    calls this): G one gather of layer 0, Q and M a row through its attention's projections and through its
    MLP's whole GEMMs (PROBE_ROWS random rows), A a row's share of an all-reduce of PROBE_ROWS hidden
    states; the workers' smallest result."""
    gathers, attention_rows, mlp_rows, reduces = [], [], [], []
    for _ in range(3):
        gathers.append(_timed(device, lambda: gather.layer_alone(0)))
        whole = gather.layer_alone(0)
        attention_rows.append(_rows_time(device, dtype, (whole.qkv, whole.o)))
        mlp_rows.append(_mlp_row_time(device, dtype, whole))
        hidden = torch.randn(PROBE_ROWS, whole.o.shape[0], device=device, dtype=dtype)
        reduces.append(_timed(device, lambda: dist.all_reduce(hidden, group=group)) / PROBE_ROWS)
    g, q, m, a = min(gathers), min(attention_rows), min(mlp_rows), min(reduces)
    # the same on every worker (each timed its own): a prompt must take the same way everywhere
    threshold = torch.tensor([int(g / (q + m / world_size + a))], device=device)
    dist.all_reduce(threshold, op=dist.ReduceOp.MIN, group=group)
    threshold = int(threshold.item())
    log.info("burst-zero: a layer's gather %.2f ms, a row through the attention's projections %.3f us and the "
             "MLP's whole GEMMs %.3f us, a row's all-reduce %.3f us: prompts of up to %d tokens run on the slices "
             "(--zero-sliced-max-tokens)", g * 1e3, q * 1e6, m * 1e6, a * 1e6, threshold)
    return threshold


def _rows_time(device: torch.device, dtype: torch.dtype, weights: tuple) -> float:
    """Seconds a row takes through these weights' GEMMs (PROBE_ROWS random rows at once)."""
    inputs = [torch.randn(PROBE_ROWS, w.shape[1], device=device, dtype=dtype) for w in weights]
    return _timed(device, lambda: [F.linear(x, w) for x, w in zip(inputs, weights)]) / PROBE_ROWS


def _mlp_row_time(device: torch.device, dtype: torch.dtype, whole) -> float:
    """Seconds a row takes through a whole layer's MLP: its GEMMs, or its experts (PROBE_ROWS random rows)."""
    if whole.experts is None:
        return _rows_time(device, dtype, (whole.gate_up, whole.down))
    x = torch.randn(PROBE_ROWS, whole.o.shape[0], device=device, dtype=dtype)
    return _timed(device, lambda: experts_mlp(x, whole.experts)) / PROBE_ROWS


def _timed(device: torch.device, fn) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start

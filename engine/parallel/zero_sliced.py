"""burst-zero's short prompts on the weight slices as they lie: tensor-parallel compute, burst's K/V layout.

Why: a burst-zero prefill gathers every layer's whole weights from the workers' tp slices, one layer ahead,
behind the previous layer's compute (engine/parallel/zero.py). A short prompt's layer computes in less
time than its gather takes, and then waits for it. Such a prompt runs instead as tensor parallelism runs
it (the BurstAttention paper's other baseline, Megatron V1): every worker runs all N tokens through its
slices (its query heads and the K/V heads they read, its MLP columns; the model's all-reduce after o and
down), attention causal over all N tokens for its own heads, no weight moved. The K/V cache stays burst's
(worker r keeps its zigzag shard's tokens, every K/V head), so decode and later extends are unchanged: per
layer one all-to-all sends each worker the rows of its shard for the K/V heads computed here, and each K/V
head is taken from the first worker that computes it (several may under GQA).

Which prompts (ZeroLayout.sliced_limit, engine/parallel/zero.py; ModelRunner.sliced_max_tokens): those of
at most --zero-sliced-max-tokens tokens; unset, on GPUs, measured at start (`measure_sliced_max_tokens`):
a layer's gather takes G seconds, a row of the prompt R seconds through a whole layer's GEMMs and A
seconds in an all-reduce of hidden states. A gathered layer of N tokens takes about max(G, N R / W) (its
gather behind the layer before), a sliced one N R / W + 2 N A (two all-reduces): sliced is faster
while N < G / (R / W + 2 A). The K/V all-to-all (smaller than the all-reduces under GQA) is left out. On CPU,
unset: none (the tests set it). Either way at most a worker's share of --max-model-len: the activation
memory the KV pool's sizing leaves is for that many rows (engine/cache/sizing.py), and a sliced row takes
less than a whole one.
"""
import logging
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.parallel.sharding import Shard
from engine.parallel.tensor_parallel import local_kv_heads

log = logging.getLogger(__name__)
SLICED = "burst-zero-sliced"    # the prefill stats' strategy of such a prompt
PROBE_ROWS = 2048           # rows through a whole layer's GEMMs when measuring R


class SlicedPrefillAttention:
    """One prompt's attention, every worker running all of its tokens through its tp slices (see the module
    docstring): __call__(layer, q [N, H_r, D], k, v [N, Hkv_r, D]) -> out [N, H_r, D], and this worker's
    shard's K/V, every head, written to its slots."""

    def __init__(self, pool, slots: torch.Tensor, shards: list[Shard], rank: int, cfg: ModelConfig,
                 backend, scale: float, group=None):
        self.pool, self.slots, self.backend, self.scale, self.group = pool, slots, backend, scale, group
        world = len(shards)
        device = slots.device
        self.sizes = [s.length for s in shards]                       # rows each worker keeps
        self.mine = self.sizes[rank]
        self.order = torch.cat([s.positions() for s in shards]).to(device)   # rows grouped by their keeper
        heads = [local_kv_heads(cfg, r, world) for r in range(world)]
        source = [next((r, heads[r].index(h)) for r in range(world) if h in heads[r]) for h in range(cfg.num_kv_heads)]
        self.source_worker = torch.tensor([r for r, _ in source], device=device)      # [Hkv]
        self.source_head = torch.tensor([i for _, i in source], device=device)        # [Hkv]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, _ = self.backend(q, k, v, True, self.scale)                               # [N, H_r, D]
        self.pool.write(layer, self.slots, *self._my_shard_every_head(k, v))
        return out

    def _my_shard_every_head(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [N, Hkv_r, D] (every token, the K/V heads computed here) -> k, v [n, Hkv, D] (this worker's
        shard's tokens, every K/V head)."""
        n_all, hkv_r, d = k.shape
        world = len(self.sizes)
        rows = torch.stack([k, v], dim=1).index_select(0, self.order)                  # [N, 2, Hkv_r, D]
        got = torch.empty((world * self.mine, 2, hkv_r, d), dtype=k.dtype, device=k.device)
        width = 2 * hkv_r * d
        dist.all_to_all_single(got.view(world * self.mine, width), rows.view(n_all, width),
                               output_split_sizes=[self.mine] * world, input_split_sizes=self.sizes,
                               group=self.group)
        got = got.view(world, self.mine, 2, hkv_r, d)
        every = got[self.source_worker, :, :, self.source_head]                         # [Hkv, n, 2, D]
        every = every.permute(1, 2, 0, 3)                                               # [n, 2, Hkv, D]
        return every[:, 0], every[:, 1]


@torch.inference_mode()
def measure_sliced_max_tokens(gather, world_size: int, device: torch.device, dtype: torch.dtype, group=None) -> int:
    """G / (R / W + 2 A) (module docstring), timed at start, best of 3 each (collective: every worker calls
    this): G one gather of layer 0, R a row through its whole weights' GEMMs (PROBE_ROWS random rows), A a
    row's share of an all-reduce of PROBE_ROWS hidden states; the workers' smallest result."""
    gathers, rows, reduces = [], [], []
    for _ in range(3):
        gathers.append(_timed(device, lambda: gather.layer_alone(0)))
        whole = gather.layer_alone(0)
        weights = (whole.qkv, whole.o, whole.gate_up, whole.down)
        inputs = [torch.randn(PROBE_ROWS, w.shape[1], device=device, dtype=dtype) for w in weights]
        rows.append(_timed(device, lambda: [F.linear(x, w) for x, w in zip(inputs, weights)]) / PROBE_ROWS)
        hidden = torch.randn(PROBE_ROWS, whole.o.shape[0], device=device, dtype=dtype)
        reduces.append(_timed(device, lambda: dist.all_reduce(hidden, group=group)) / PROBE_ROWS)
    g, r, a = min(gathers), min(rows), min(reduces)
    # the same on every worker (each timed its own): a prompt must take the same way everywhere
    threshold = torch.tensor([int(g / (r / world_size + 2 * a))], device=device)
    dist.all_reduce(threshold, op=dist.ReduceOp.MIN, group=group)
    threshold = int(threshold.item())
    log.info("burst-zero: a layer's gather %.2f ms, a row through its whole GEMMs %.3f us, a row's all-reduce "
             "%.3f us: prompts of up to %d tokens run on the weight slices (--zero-sliced-max-tokens)",
             g * 1e3, r * 1e6, a * 1e6, threshold)
    return threshold


def _timed(device: torch.device, fn) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start

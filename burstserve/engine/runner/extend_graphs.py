"""A small incremental prefill as a CUDA graph: the next chunk of a chunked prefill, or a short prompt after
its cached prefix, in the "local" and "whole" ways of engine/runner/extend_attention.py, one graph per chunk size.

Why: a late chunk of a long prompt (256 new tokens after 116K cached) launches ~540 kernels eagerly, and
its host time, not its GPU work, decides how long it takes, so it varies with the machine's CPU
(docs/benchmarks.md, Chunked prefill and interference). On two workers every layer also meets a
collective, so the slower host of the two sets the pace. Replayed as one graph, the host issues one
call.

Graphs: one for each chunk size in SIZES (multiples of 128 up to MAX_TOKENS rows a worker; with --mixed-batch the
sizes up to MIXED_MAX_TOKENS also with a decode step); a chunk of n tokens runs in
the smallest of at least n rows, rows n.. being padding (token 0, the positions after the chunk, the scratch
slot): they come after the real rows, so the chunk's causal attention keeps them out of the real rows, and
their results are dropped. Captured at worker start on every worker in the same order (the collectives
inside must line up), after an eager warm-up that compiles the kernels.

On W workers holding the sequence's K/V ("whole" way: one worker keeps the chunk's K/V) the chunk's rows are
split: worker r runs rows r*M .. (r+1)*M - 1 through the GEMMs (M: the smallest size with W x M >= n), so
the padding rows all come after the chunk's; a graph of M rows serves chunks of up to W x M tokens.

Static inputs, one int64 buffer copied in before each replay: this worker's token ids [M] and positions
[M], slots [W M] (where the keeper writes the chunk's K/V, every row's; the scratch slot for padding rows
and on the other workers), then meta [5]: the sequence's row of the pool's page table, its keys on this
worker before the chunk, 1 if this worker keeps the chunk's K/V, the worker holding the chunk's last row
and that row's index there.

Attention per layer: the chunk's queries against this worker's cached keys cut into runs of pages
(kernels.paged_attention.device_prefix_runs: built once a replay, on the device, from the page-table row
and the cached count; one flash-attn-4 call over all runs without a mask) and causally against the
chunk's own K/V (the backend's dense call; weighing 0 on a worker that does not keep them), merged by LSE
in one kernel that skips runs without keys (GraphedChunkAttention.partial). On W workers
(ShardedChunkAttention) one all-gather first gives every worker all W x M rows' q, k, v, each attends them
all to the keys it holds, and one all-to-all returns every worker the W partials of its own rows, merged
in fp32 (pass-Q over the chunk: the GEMMs split, two collectives a layer). The chunk's last row's hidden
state is all-gathered for its logits. The same code runs without capture (`capture=False`): the CPU tests
check it against transformers and the eager extend.
"""
import logging
import os
import time

import torch

import torch.distributed as dist

from burstserve.engine.parallel.decode_attention import all_gather
from burstserve.kernels.device import num_sms
from burstserve.kernels.merge import merge_partials
from burstserve.kernels.paged_attention import (MAX_RUNS, attention_ctas, device_prefix_runs, fa4_available,
                                                paged_attention, runs_filling_waves)

log = logging.getLogger(__name__)

STEP = 128                  # chunk sizes are multiples of the page size (engine/scheduler/chunk_sizer.py aligns them)
MAX_TOKENS = 2048           # rows a worker; larger chunks keep the GPU busy eagerly (their GPU work outlasts
                            # the launches). Up to 2048, not 1024: on 2 workers chunks of 2049-4095 tokens
                            # (below --extend-ring-min-tokens) then split their GEMMs instead of running them
                            # eagerly on both workers
MIXED_MAX_TOKENS = 1024     # rows a worker of the sizes also captured with a decode step (--mixed-batch): larger
                            # chunks run, then a decode step (at 1024 tokens one graph of both is no faster than
                            # the two graphs apart: docs/benchmarks.md, Chunked prefill and interference)
SIZES = tuple(range(STEP, MAX_TOKENS + 1, STEP))
META = 5                    # page-table row, cached keys here, keeps the new K/V (1/0), the worker and its row
                            # whose logits return
# Test hook: "1" makes CPU workers run small extends through the graphs' forward uncaptured (capture=False),
# so the CPU tests check the graphs' code against transformers; GPUs always capture, CPUs otherwise run eagerly
ON_CPU_ENV = "BURSTSERVE_EXTEND_GRAPHS_ON_CPU"
MIXED_BUCKETS = (8, 32, 128, 512)   # --mixed-batch: a step's decode rows padded up to one of these (and max_num_seqs)


def mixed_buckets(max_num_seqs: int) -> list[int]:
    return [b for b in MIXED_BUCKETS if b < max_num_seqs] + [max_num_seqs]


def runs_for(rows: int, q_per_kv: int, num_kv_heads: int, sms: int) -> int:
    """Runs of the cached keys for a chunk of `rows` queries: the CTAs fill the SMs' waves best
    (kernels.paged_attention.runs_filling_waves; prefix_run_count also caps runs by the cached length:
    here the runs are fixed per graph, and a run without keys costs nothing but its CTAs)."""
    return runs_filling_waves(attention_ctas(rows, q_per_kv, num_kv_heads), sms, MAX_RUNS)


class GraphedChunkAttention:
    """One replay's attention for every layer: see the module docstring. Built inside the captured forward,
    from the static inputs' views."""

    def __init__(self, runner, slots: torch.Tensor, meta: torch.Tensor, runs: int):
        self.pool, self.scale, self.backend = runner.pool, runner.scale, runner.backend
        self.world_size, self.group = runner.strategy.kv_workers, runner.data_group
        self.slots, self.runs = slots, runs
        row = runner.pool.table.index_select(0, meta[0:1])                           # [1, P] int32
        self.table, used = device_prefix_runs(row, meta[1:2].to(torch.int32), runs, runner.pool.block_size)
        self.used = torch.cat([used, meta[2:3].to(torch.int32)])                      # [runs + 1]: the new K/V last
        m = slots.shape[0]
        self.cu = torch.arange(0, (runs + 1) * m, m, dtype=torch.int32, device=slots.device)   # [runs + 1]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [m, H, D], k and v [m, Hkv, D] -> out [m, H, D] (one worker holds every key: "local")."""
        return self.partial(layer, q, k, v)[0]

    def partial(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The chunk's rows q [m, H, D] against this worker's keys (its cached ones; the chunk's own k, v
        [m, Hkv, D] causally where it keeps them, written to its slots first) -> (out [m, H, D], lse [m, H])."""
        m, h, _ = q.shape
        self.pool.write(layer, self.slots, k, v)
        q_runs = q.repeat(self.runs, 1, 1) if self.runs > 1 else q                     # [runs * m, H, D]
        out, lse = paged_attention(q_runs, *self.pool.layer(layer), self.table, self.cu, self.used[:-1],
                                   self.scale, causal=False, num_chunks=1, max_seqlen_q=m, rows_see_keys=True)
        new_out, new_lse = self.backend(q, k, v, True, self.scale)                      # the chunk's own keys
        outs = torch.cat([out.view(self.runs, m, h, -1), new_out[None]])               # [runs + 1, m, H, D]
        lses = torch.cat([lse.reshape(self.runs, m, h), new_lse[None]])                 # [runs + 1, m, H]
        return merge_partials(outs, lses, q.dtype, self.used)


class ShardedChunkAttention(GraphedChunkAttention):
    """The chunk's rows split over the W workers (each runs M of the W x M rows through the GEMMs): per layer
    one all-gather gives every worker all rows' q, k, v; each attends all of them to the keys it holds (as
    GraphedChunkAttention.partial), and one all-to-all returns every worker the W partials of its own M
    rows, merged in fp32."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [M, H, D], k and v [M, Hkv, D] (this worker's rows) -> out [M, H, D]."""
        m, h, d = q.shape
        hkv = k.shape[1]
        rows = torch.cat([q, k, v], dim=1)                                              # [M, H + 2 Hkv, D]
        every = all_gather(rows, self.world_size, self.group).view(self.world_size * m, h + 2 * hkv, d)
        out, lse = self.partial(layer, *every.split([h, hkv, hkv], dim=1))             # [W M, H, D], [W M, H]
        packed = torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1)                    # [W M, H, D + 1]
        mine = torch.empty_like(packed)              # block j: worker j's partial of this worker's rows
        dist.all_to_all_single(mine, packed, group=self.group)
        mine = mine.view(self.world_size, m, h, d + 1)
        return merge_partials(mine[..., :-1], mine[..., -1], q.dtype)[0]


class ExtendGraphs:
    @classmethod
    def create(cls, runner, engine) -> "ExtendGraphs | None":
        """Graphs for this worker's small extends, or None (eager), as DecodeGraphs decides: CUDA with
        flash-attn-4 (its paged call reads lengths only on the device), not burst-zero (its small extends run
        on the MLP's slices, whose partial sums an all-reduce adds up: every worker must hold the same rows,
        not a shard of them), not FP8 pages (an extend gathers them)."""
        if runner.whole_layers is not None or engine.max_num_batched_tokens is None and not engine.enable_prefix_caching:
            return None
        sizes = [m for m in SIZES if m < runner.max_model_len + STEP]        # up to the first that holds any prompt
        chunked = engine.max_num_batched_tokens is not None
        decode = mixed_buckets(engine.max_num_seqs) if chunked and engine.mixed_batch is not False else []
        if runner.device.type != "cuda":               # the tests' way to run the graphs' forward, uncaptured
            return cls(runner, sizes, decode, capture=False) if os.environ.get(ON_CPU_ENV) == "1" else None
        if not engine.cuda_graphs or not fa4_available(runner.device) or runner.pool.fp8:
            return None                                # (an extend over FP8 pages gathers them: not capturable)
        return cls(runner, sizes, decode)

    def __init__(self, runner, sizes: list[int], decode_buckets: list[int] = (), capture: bool = True):
        """sizes: the chunk sizes graphed; decode_buckets (--mixed-batch): each size also with a decode step of
        up to that many sequences in the same forward pass (ModelRunner.extend_and_decode)."""
        self.runner, self.sizes, self.decode_buckets = runner, sizes, list(decode_buckets)
        self.workers = runner.strategy.kv_workers          # > 1: the chunk's rows split over them ("whole" way)
        mixed = [m for m in sizes if m <= MIXED_MAX_TOKENS] if self.decode_buckets else []
        self.mixed_max_tokens = self.workers * mixed[-1] if mixed else 0   # the largest chunk mixed with a step
        cfg = runner.attn_cfg
        sms = num_sms(runner.device) if runner.device.type == "cuda" else 132
        self.runs = {m: runs_for(self.workers * m, cfg.num_heads // cfg.num_kv_heads, cfg.num_kv_heads, sms)
                     for m in sizes}
        self.inputs = torch.zeros((2 + self.workers) * sizes[-1] + META, dtype=torch.int64, device=runner.device)
        # a mixed call's decode step: DecodeGraphs' five rows, padding rows past the batch
        self.step_padding = torch.zeros(5, max(self.decode_buckets, default=0), dtype=torch.int64, device=runner.device)
        self.step_padding[4] = runner.pool.pad_row
        self.step_inputs = self.step_padding.clone()
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}     # (chunk rows, decode rows)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        if capture:
            start = time.perf_counter()
            self._capture_all()
            log.info("extend CUDA graphs for chunks of %s tokens%s captured in %.1f s", sizes,
                     f" (and with decode steps of {self.decode_buckets} sequences)" if self.decode_buckets else "",
                     time.perf_counter() - start)

    def fits(self, num_tokens: int, decode_rows: int = 0) -> bool:
        if decode_rows:
            return 0 < num_tokens <= self.mixed_max_tokens and decode_rows <= self.decode_buckets[-1]
        return 0 < num_tokens <= self.workers * self.sizes[-1]

    def run(self, token_ids: torch.Tensor, start: int, slots: torch.Tensor | None, table_row: int, cached: int,
            step_inputs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """token_ids [n] int64 (host): the sequence's tokens start .. start+n-1, all run on this worker;
        slots [n] int64 (host) where this worker keeps their K/V, or None if it does not; table_row: the
        sequence's row of the pool's page table; cached: its keys on this worker before them; step_inputs
        (a mixed call): a decode step's [5, B] int64 (host, WorkerCache.place_decode_tokens) -> (the last token's
        logits [V] fp32, the decode rows' logits [B, V] fp32 or None), on the device."""
        n, w = token_ids.shape[0], self.workers
        m = next(x for x in self.sizes if w * x >= n)       # rows a worker runs: its block of the chunk, padded
        first = self.runner.rank * m if w > 1 else 0
        mine = token_ids[first:first + m]
        base = (2 + w) * m
        host = torch.zeros(base + META, dtype=torch.int64)
        host[:mine.shape[0]] = mine
        host[m:2 * m] = torch.arange(start + first, start + first + m)
        if slots is not None:
            host[2 * m:2 * m + n] = slots                       # all n rows' K/V; padding: the scratch slot
        owner = (n - 1) // m
        host[base:] = torch.tensor([table_row, cached, int(slots is not None), owner, n - 1 - owner * m])
        self.inputs[:base + META].copy_(host)     # blocking: the host buffer is not kept (see DecodeGraphs.run)
        b = bucket = 0
        if step_inputs is not None:
            b = step_inputs.shape[1]
            bucket = next(x for x in self.decode_buckets if x >= b)
            self.step_inputs[:, :b].copy_(step_inputs)
            self.step_inputs[:, b:bucket] = self.step_padding[:, b:bucket]
        if (m, bucket) in self.graphs:
            self.graphs[m, bucket].replay()
            logits = self.outputs[m, bucket]
        else:
            logits = self.forward(m, bucket)
        return logits[0], (logits[1:1 + b] if step_inputs is not None else None)

    def forward(self, m: int, b: int = 0) -> torch.Tensor:
        """The chunk's m rows of this worker (and b decode rows) from the static inputs -> logits [1 + b, V]
        fp32: the chunk's last row's (the meta's worker and row), then the decode rows'."""
        runner, w = self.runner, self.workers
        base = (2 + w) * m
        ids, positions, slots = self.inputs[:m], self.inputs[m:2 * m], self.inputs[2 * m:base]   # slots [w m]
        meta = self.inputs[base:base + META]
        chunk = (ShardedChunkAttention if w > 1 else GraphedChunkAttention)(runner, slots, meta, self.runs[m])
        def mixed(layer, q, k, v):                          # rows: m of the chunk, then b decode
            return torch.cat([chunk(layer, q[:m], k[:m], v[:m]), runner.decode_attention(layer, q[m:], k[m:], v[m:])])

        if b:
            step = self.step_inputs[:, :b]
            runner.decode_attention.begin_step(step, None)
            ids, positions = torch.cat([ids, step[0]]), torch.cat([positions, step[1]])
        hidden = runner.model.forward(ids, positions, mixed if b else chunk)                          # [m + b, hidden]
        last = hidden.index_select(0, meta[4:5])                                        # [1, hidden]
        if w > 1:                                                    # the owner's row, on every worker
            last = all_gather(last, w, runner.data_group).view(w, -1).index_select(0, meta[3:4])
        return runner.model.logits(torch.cat([last, hidden[m:m + b]]) if b else last)   # [1 + b, V]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        runner = self.runner
        device = runner.device
        for m in self.sizes:                        # the warm-up's inputs: scratch pages, a run of keys each
            base = (2 + self.workers) * m
            self.inputs[base:base + META] = torch.tensor([runner.pool.pad_row, self.runs[m] * runner.pool.block_size,
                                                          1, 0, m - 1])
        shapes = [(m, b) for m in self.sizes for b in [0] + (self.decode_buckets if m <= MIXED_MAX_TOKENS else [])]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):                      # warm-up: kernel compilation, allocator
                for m, b in shapes:
                    self.forward(m, b)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        for m, b in reversed(shapes):               # largest first: the others reuse its memory
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[m, b] = self.forward(m, b)
            self.graphs[m, b] = graph
        torch.cuda.synchronize(device)

"""The decode step as CUDA graphs, one per batch-size bucket (1, 2, 4, .., max_num_seqs).

A step's inputs are five int64 rows (tokens, positions, slots, keys held, page-table rows, see
WorkerCache.place_decode_tokens) copied into one static buffer; rows past the batch are padding (token 0,
the scratch slot, no keys, the pool's all-scratch table row), whose outputs are dropped. The whole
forward (embedding, every layer's K/V write, paged attention, the all-gather of partials with NCCL,
the LM head) is one replay. Captured at worker start on every worker in the same order (the
collectives inside must line up), after an eager warm-up that also compiles the kernels, so no
request pays for either. Used only where every kernel is capturable: CUDA with flash-attn-4's
paged attention (the dense fallback reads lengths on the host).
"""
import logging
import time

import torch

from burstserve.engine.core.devices import host_to_device
from burstserve.kernels.paged_attention import fa4_available

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def batch_buckets(max_num_seqs: int) -> list[int]:
    buckets = [b for b in BUCKETS if b < max_num_seqs]
    return buckets + [max_num_seqs]


def release_graphs(*holders) -> None:
    """Resets and drops every CUDA graph of these holders (DecodeGraphs, ExtendGraphs, or None)."""
    for holder in holders:
        if holder is not None:
            for graph in holder.graphs.values():
                graph.reset()
            holder.graphs.clear()
            holder.outputs.clear()


class DecodeGraphs:
    @classmethod
    def create(cls, runner, engine) -> "DecodeGraphs | None":
        """Graphs for this worker, or None (eager decode) with the reason logged."""
        if runner.device.type != "cuda":
            return None
        if not engine.cuda_graphs:
            log.info("decode CUDA graphs off (cuda_graphs=False / --enforce-eager)")
            return None
        if not fa4_available(runner.device) and not runner.pool.fp8:   # FP8 pages: a Triton kernel of our own
            log.warning("decode runs eagerly: CUDA graphs need flash-attn-4's paged attention "
                        "(pip install 'burstserve[flash-attn]', SM90 or newer)")
            return None
        return cls(runner, batch_buckets(engine.max_num_seqs))

    def __init__(self, runner, buckets: list[int]):
        self.runner, self.buckets = runner, buckets
        self.max_batch = buckets[-1]
        device = runner.device
        self.padding = torch.zeros(5, self.max_batch, dtype=torch.int64, device=device)
        self.padding[4] = runner.pool.pad_row
        self.inputs = self.padding.clone()                       # [5, max_batch] static
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        start = time.perf_counter()
        self._capture_all()
        log.info("decode CUDA graphs for batch sizes %s captured in %.1f s", buckets, time.perf_counter() - start)

    def fits(self, batch: int) -> bool:
        return batch <= self.max_batch

    def run(self, step_inputs: torch.Tensor, fed: tuple | None = None) -> torch.Tensor:
        """step_inputs [5, B] int64 (host) -> logits [B, V] fp32 (device). fed: (tokens, rows) on the device,
        the input tokens are tokens[rows] (asynchronous scheduling, engine/runner/step_tokens.py)."""
        b = step_inputs.shape[1]
        bucket = next(x for x in self.buckets if x >= b)
        # through pinned memory: a copy from pageable memory would make the host wait for the step in flight
        self.inputs[:, :b].copy_(host_to_device(step_inputs, self.inputs.device))
        if fed is not None:
            torch.index_select(fed[0], 0, fed[1], out=self.inputs[0, :b])
        if b < bucket:
            self.inputs[:, b:bucket] = self.padding[:, b:bucket]
        self.graphs[bucket].replay()
        return self.outputs[bucket][:b]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream):
            for _ in range(2):                                    # warm-up: kernel compilation, allocator
                for b in self.buckets:
                    self.runner.decode_forward(self.inputs[:, :b])
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        torch.cuda.synchronize(self.runner.device)
        for b in reversed(self.buckets):                          # largest first: the others reuse its memory
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.runner.decode_forward(self.inputs[:, :b])
            self.graphs[b] = graph
        torch.cuda.synchronize(self.runner.device)

"""What one worker does: hold the model replica and its KV shard, run prefill and decode steps.

Every worker runs the same method with the same arguments (worker 0 broadcasts the call); the
logits come back on worker 0 only.
"""
import logging
import time

import torch
import torch.distributed as dist

from burstserve.engine.core.calls import (Adopt, Decode, DecodeAhead, DecodeResult, Extend, ExtendAndDecode, Fork, Free,
                                          HostFree, Offload, Prefill, PrefillResult, PumpStores, Reinstate, Restore,
                                          Retire, Truncate)
from burstserve.engine.core.devices import host_to_device, synchronize
from burstserve.engine.core.messages import WorkerFacts
from burstserve.engine.core.placement import ExtendWay, Shard, owner_of_position
from burstserve.engine.core.prompt_logprobs import as_entries
from burstserve.engine.model.config import DTYPES, EngineConfig, ModelConfig
from burstserve.engine.model.model import hf_weight_shapes
from burstserve.engine.model.weights import load_weights, random_weights, weight_bytes
from burstserve.engine.parallel import PrefillContext, get_strategy, kv_view
from burstserve.engine.parallel.decode_attention import DecodeAttention
from burstserve.engine.parallel.exchange_time import ExchangeTime
from burstserve.engine.parallel.pass_kv import PassKVChoice
from burstserve.engine.parallel.ring import RingCommunicator
from burstserve.engine.runner.decode_graphs import DecodeGraphs, release_graphs
from burstserve.engine.runner.extend_attention import ExtendAttention, warm_extend_kernels
from burstserve.engine.runner.extend_graphs import ExtendGraphs
from burstserve.engine.runner.step_tokens import FedTokens, PendingTokens, sampled_next, sampled_result, with_step
from burstserve.engine.runner.worker_cache import AfterRestore, PlacedExtend, WorkerCache
from burstserve.engine.runner.worker_memory import check_weights_fit, peak_memory_all_workers
from burstserve.kernels.attention import select_backend, windowed_attention
from burstserve.kernels.kv_quant import SCALE_BYTES, is_fp8
from burstserve.kernels.paged_attention import fa4_available

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, engine: EngineConfig, cfg: ModelConfig, rank: int, device: torch.device, data_group=None,
                 max_model_len: int = 1 << 20):
        self.engine, self.cfg, self.rank, self.device = engine, cfg, rank, device
        self.world_size = engine.world_size
        self.data_group = data_group
        dtype = DTYPES[engine.dtype]
        self.strategy = get_strategy(engine.sp_strategy, self.world_size)   # how a prefill spans the workers
        shapes = hf_weight_shapes(cfg)
        slices = self.strategy.weight_slices(cfg, rank)                     # tp: this worker's part of each
        check_weights_fit(engine, rank, weight_bytes(shapes, dtype.itemsize, slices), device)
        if engine.is_preset:
            weights = random_weights(shapes, device, dtype, engine.seed, slices)
        else:
            weights = load_weights(engine.model, list(shapes), device, dtype, slices)
        self.layout = self.strategy.weight_layout(cfg, rank, device, data_group)   # what follows from the weights
        attn = self.layout.attn_cfg                    # the heads a prefill attends with and the K/V cache holds
        self.backend = select_backend(device, dtype, attn.num_heads, attn.num_kv_heads, cfg.head_dim, engine.kernel)
        self.model = self.layout.build_model(weights, self._all_reduce, engine.quantization, engine.kv_cache_dtype, self.backend.fp8)
        self.whole_layers = self.layout.whole_layers   # a prefill's layers gathered whole (burst-zero), or None
        self.scale = cfg.scale
        multi_ring = self.strategy.kv_workers > 1   # K/V spread over several workers (a ring, even if unused)
        self.ring = RingCommunicator(rank, self.world_size, device, data_group) if multi_ring else None
        self.kv_fp8 = is_fp8(engine.kv_cache_dtype)
        self.ring_fp8 = self.kv_fp8 and not self.backend.fp8     # a ring sends K/V's FP8 bytes (not rounded: fa3-fp8)
        self.prefill_context = PrefillContext(self.backend, self.scale, self.ring, engine.overlap, data_group,
                                              cfg.num_heads, engine.auto_ulysses_max_tokens, self.ring_fp8)
        note = self.strategy.fallback_note(cfg)
        if note and rank == 0:
            log.warning("%s", note)
        self.dtype, self.attn_cfg = dtype, attn
        self.block_size = engine.page_size
        self.max_model_len = max_model_len
        self.cache, size = WorkerCache.build(engine, cfg, attn.num_kv_heads, dtype, self.strategy, self.layout, device,
                                             rank, data_group, max_model_len)   # its pages sized from memory
        self.pool = self.cache.pool
        self.prefill_rows_max = size.prefill_rows_max
        self.passes_kv = PassKVChoice(engine, attn.num_kv_heads, cfg.head_dim, dtype.itemsize, size.pass_q_reserve_bytes,
                                      device, rank)   # a "ring" extend's way of passing
        share = self.strategy.kv_share(max_model_len)   # a worker's share of the longest sequence
        self.decode_attention = DecodeAttention(self.pool, self.scale, self.strategy.kv_workers, data_group, windows=cfg.layer_windows)
        # prompts this short run on the weight slices (burst-zero; else 0)
        self.sliced_max_tokens = self.layout.sliced_limit(engine.zero_sliced_max_tokens, share, self.prefill_context)
        self.graphs = DecodeGraphs.create(self, engine)    # None: eager decode (CPU, or no capturable kernel)
        self.fed_tokens = FedTokens(engine.max_num_seqs + 1, device, rank, self.world_size, data_group)
        self.extend_graphs = ExtendGraphs.create(self, engine)   # None: small extends run eagerly
        if device.type == "cuda" and fa4_available(device) and not self.kv_fp8:   # none built under load
            warm_extend_kernels(self.pool, self.backend, self.scale, attn.num_heads, attn.num_kv_heads, cfg.head_dim,
                                dtype)
            self._sync()
        # the yardstick of hidden_fraction: a ring step's time alone, timed once here (collective), for the
        # block the ring sends (FP8 pages: FP8 bytes and a scale a row)
        message = ((2, attn.num_kv_heads, cfg.head_dim + SCALE_BYTES), torch.uint8) if self.ring_fp8 else \
            ((2, attn.num_kv_heads, cfg.head_dim), dtype)
        self.exchange_time = (ExchangeTime.measure(self.ring, self.world_size, rank, *message, device)
                              if self.ring is not None else None)
        log.info("worker %d: KV pool of %d pages x %d tokens (%.2f GiB, %s), decode %s", rank, self.pool.num_pages,
                 self.block_size, self.pool.bytes() / 2**30,
                 "FP8 with a scale per token and head" if self.pool.fp8 else str(dtype).removeprefix("torch."),
                 "in CUDA graphs" if self.graphs else "eager")

    def execute(self, call):
        """The worker's one entry point (worker 0's and every other's): one call of engine/core/calls.py run on
        this runner, a cache change on its WorkerCache -> its result (kept on worker 0, dropped elsewhere). The
        host tier's queued stores go out a slice before and after it."""
        self.cache.pump_stores()
        kind = type(call)
        result = WORK[kind](self, call) if kind in WORK else CACHE_CHANGES[kind](self.cache, call)
        self.cache.pump_stores()
        return result

    @torch.inference_mode()
    def prefill(self, call: Prefill) -> PrefillResult:
        """call.token_ids [N] int64 (CPU). Returns timings, and on worker 0 the logits [V] (CPU fp32) and with
        `prompt_logprobs` (top k) one entry per prompt position (see engine/core/prompt_logprobs.py)."""
        entered = time.perf_counter()
        token_ids, prompt_logprobs = call.token_ids, call.prompt_logprobs
        num_tokens = token_ids.shape[0]
        shards = self.strategy.shards(num_tokens)
        if prompt_logprobs is None and num_tokens <= self.sliced_max_tokens:   # on the weight slices (burst-zero)
            start, _, slots = self._begin_prefill(call, shards)
            logits = self.layout.prefill_on_slices(self.prefill_context, self.pool, slots, shards, token_ids)   # [V]
            return self._prefill_result(call, self.layout.sliced_name, logits, start, entered)
        chosen = self.strategy.for_prompt(num_tokens, self.prefill_context)   # auto: ulysses or burst
        attention = chosen.attention(self.prefill_context, shards, self.rank)   # (q, kv, between) -> [n, H, D]
        exchange_alone = (self.exchange_time.prompt_seconds(shards, self.cfg.num_layers)
                          if self.exchange_time is not None and chosen.times_exchanges else 0.0)   # no K/V ring: 0
        start, shard, slots = self._begin_prefill(call, shards)           # slots [n]
        n, positions = shard.length, shard.positions()                      # [n]
        seq_parallel = chosen.sequence_parallel(num_tokens, self.rank, self.data_group)   # tp-v3
        local_ids = (seq_parallel.local_ids(token_ids) if seq_parallel else token_ids[positions]).to(self.device)
        if seq_parallel:                                                # every row, the padding's positions too
            positions = torch.arange(seq_parallel.padded)

        def attend(layer, q, k, v):                                     # q [n, H, D], k, v [n, Hkv, D]
            store = lambda: self.pool.write(layer, slots, k[:n], v[:n])   # noqa: E731  (tp-v3: not the padding's)
            if self.cfg.window(layer) is not None:   # every worker holds every position (window_refusal): in order
                store()
                return windowed_attention(q, k, v, self.scale, self.cfg.window(layer))[0]
            kv = torch.stack([k, v], dim=1) if self.ring is not None else kv_view(k, v)   # [n, 2, Hkv, D]
            return attention(q, kv, store)                               # (a ring sends kv: contiguous)

        hidden = self.model.forward(local_ids, positions.to(self.device), attend, seq_parallel,
                                    self.whole_layers)                                       # [n, hidden]
        last = seq_parallel.last_row() if seq_parallel else owner_of_position(shards, num_tokens - 1)
        logits = self.layout.logits_of_row(hidden, *last)                  # [V], on every worker
        stats = self.ring.collect_stats() if self.ring else None
        result = self._prefill_result(call, chosen.name, logits, start, entered, stats, exchange_alone)
        if prompt_logprobs is not None:                                 # its time counts in wrapup_seconds
            wrapup = time.perf_counter()
            if seq_parallel:                                            # every row on every worker, as tp
                hidden, positions = seq_parallel.gather(hidden)[:n], positions[:n]
            parts = self.layout.prompt_scores(hidden, positions, token_ids, prompt_logprobs, self.strategy.replicated_kv)
            if self.rank == 0:
                result.prompt_logprobs = as_entries(parts, token_ids)
            result.wrapup_seconds += time.perf_counter() - wrapup
        return result

    def _begin_prefill(self, call: Prefill, shards: list[Shard]) -> tuple[float, Shard, torch.Tensor]:
        """A prefill's start (every worker's queue drained, the peak memory counted from here) and its prompt
        placed (on the pages the call names) -> (start time, this worker's Shard, its slots [n])."""
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)   # the peak of this prefill alone
        start = time.perf_counter()
        shard, slots = self.cache.place_prompt(call.seq_id, shards, call.pages)
        return start, shard, slots

    def _prefill_result(self, call: Prefill, strategy: str, logits: torch.Tensor, start: float, entered: float,
                        stats=None, exchange_alone: float = 0.0) -> PrefillResult:
        """After a prefill's forward: its timings (stats: the K/V ring's, against its exchanges' time alone), the
        workers' peak memory, and on worker 0 what the call's SampleNext asks of the logits [V]."""
        self._sync()
        end = time.perf_counter()
        result = PrefillResult(end - start, strategy, setup_seconds=start - entered)
        if stats is not None:
            result.exposed_seconds, result.exchange_overlapped_seconds = stats.exposed_seconds, stats.exchange_seconds
        if stats is not None and exchange_alone > 0:   # hidden: share of the exchanges' time alone that compute covered
            share = 1.0 - stats.exposed_seconds / exchange_alone
            result.exchange_seconds, result.hidden_fraction = exchange_alone, min(1.0, max(0.0, share))
        if self.device.type == "cuda":
            result.peak_memory_bytes = peak_memory_all_workers(self.device, self.world_size, self.data_group)
        if self.rank == 0 and call.sample_next is not None:
            result.token, result.logprobs, result.logits = sampled_next(logits, call.sample_next)
        result.wrapup_seconds = time.perf_counter() - end   # stats and logits after the prefill
        return result

    @torch.inference_mode()
    def extend(self, call: Extend) -> PrefillResult:
        """An incremental prefill: token_ids [n] int64 (CPU), the sequence's tokens start .. start+n-1 after the
        `start` cached (a chunk, or a prompt past its cached prefix), in the way its placement names
        (engine/runner/extend_attention.py) -> timings, and on worker 0 what its SampleNext asks."""
        return self._extend(call, None)

    @torch.inference_mode()
    def extend_and_decode(self, call: ExtendAndDecode) -> PrefillResult:
        """A chunk (as `extend`) and a decode step of other sequences (as `decode`) in one forward pass (Sarathi's
        mixed batch: the chunk's rows, then the B decode rows; one CUDA graph where engine/runner/extend_graphs.py
        has one) -> `extend`'s result, and on worker 0 in its `decode` what `decode` returns."""
        return self._extend(call.extend, call.decode)

    def _extend(self, call: Extend, step: Decode | None) -> PrefillResult:
        """extend, with `step` (a decode step of other sequences) in the same forward pass when given."""
        seq_id, token_ids, start = call.seq_id, call.token_ids, call.start
        rows = len(step.seq_ids) if step is not None else 0
        strategy = "extend+decode" if step is not None else "extend"
        self._sync()
        start_time = time.perf_counter()
        waits = self.cache.restore_waits(seq_id)                          # a restore still copying
        placed = self.cache.place_extend(seq_id, token_ids.shape[0], call.placed)   # a step's tokens after it
        if self._graphed_extend(placed, rows):
            self.cache.wait_restore(waits)
            step_inputs = self.cache.place_decode_tokens(step) if step is not None else None
            logits, decode_logits = self.extend_graphs.run(token_ids, start, placed.host_slots if placed.keeps else None,
                                                           self.pool.rows[seq_id], placed.cached, step_inputs)
            result = self._extend_result(call, logits, start_time, strategy, placed.way, graphed=True)
            return with_step(self.cache.with_restore(seq_id, result), decode_logits, step, self.rank)
        last, ids, positions, chunk = self._begin_extend(seq_id, token_ids, start, placed, waits)
        decode_logits = None
        if step is not None:
            step_inputs = self.cache.place_decode_tokens(step).to(self.device)                     # [5, B]
            self.decode_attention.begin_step(step_inputs, max(len(self.pool.pages[s]) for s in step.seq_ids))
            m = ids.shape[0]

            def attend(layer, q, k, v):                                 # rows: m of the chunk, then B decode
                return torch.cat([chunk(layer, q[:m], k[:m], v[:m]),
                                  self.decode_attention(layer, q[m:], k[m:], v[m:])])
            ids, positions = torch.cat([ids, step_inputs[0]]), torch.cat([positions, step_inputs[1]])
            attention, whole_layers = attend, None
        else:
            attention, whole_layers = self.layout.extend_attention(chunk)   # burst-zero: "whole" on the slices
        hidden = self.model.forward(ids, positions, attention, whole_layers=whole_layers)   # [m (+ B), hidden]
        m = hidden.shape[0] - rows
        logits = self.layout.logits_of_row(hidden[:m], *last)                      # [V], on every worker
        if step is not None:
            decode_logits = self.model.logits(hidden[m:])                           # [B, V]
        result = self._extend_result(call, logits, start_time, strategy, chunk.reported_way)
        return with_step(self.cache.with_restore(seq_id, result), decode_logits, step, self.rank)

    def _graphed_extend(self, placed: PlacedExtend, decode_rows: int = 0) -> bool:
        """Whether an extend so placed (and decode_rows decode rows) replays a CUDA graph (engine/runner/extend_graphs.py):
        its way runs every new token in order on every worker ("whole"; "local"), a graph that large (every worker alike)."""
        n = placed.shards_tokens
        return (self.extend_graphs is not None and self.extend_graphs.fits(n, decode_rows) and placed.way != ExtendWay.RING
                and placed.positions.shape[0] == n and bool((placed.positions == torch.arange(n)).all()))

    def _begin_extend(self, seq_id: int, token_ids: torch.Tensor, start: int, placed: PlacedExtend,
                      restore_waits: list | None = None):
        """An eager extend of the n new tokens `placed` put after the sequence's `start` cached ones ->
        ((worker, row) whose hidden state is the last token's, the rows this worker runs: token ids [m]
        and positions [m] on the device (its shard; "whole": all n), its ExtendAttention). restore_waits: the
        layer events of a restore from the host tier still copying, waited for layer by layer."""
        n = token_ids.shape[0]
        way, shards, positions = placed.way, placed.shards, placed.positions
        slots = placed.host_slots.to(self.device)
        attend = ExtendAttention(self.pool, seq_id, placed.cached, slots, shards, self.rank, self.backend, self.scale,
                                 self.ring, self.engine.overlap, self.data_group, way, self.ring_fp8,
                                 placed.cached_all if self.passes_kv(placed) else None, self.cfg.layer_windows)
        if restore_waits:
            attend = AfterRestore(attend, restore_waits)
        last = (0, n - 1) if way == ExtendWay.WHOLE else owner_of_position(shards, n - 1)
        return last, token_ids[positions].to(self.device), (positions + start).to(self.device), attend

    def _extend_result(self, call: Extend, logits: torch.Tensor, start_time: float, strategy: str, way: str,
                       graphed: bool = False) -> PrefillResult:
        """After an incremental prefill's forward: its timings and way, and on worker 0 what its SampleNext asks."""
        if self.ring is not None:
            self.ring.collect_stats()                                    # not reported: a chunk's ring is short
        self._sync()
        result = PrefillResult(time.perf_counter() - start_time, strategy, cached_tokens=call.start, extend_way=way,
                               graphed=graphed)
        if self.rank == 0 and call.sample_next is not None:
            result.token, result.logprobs, result.logits = sampled_next(logits, call.sample_next)
        return result

    @torch.inference_mode()
    def decode(self, call: Decode) -> DecodeResult | None:
        """One new token per sequence. On worker 0: every row's token (the argmax, or drawn on the device
        by its RowSampling), the logits of the rows the host samples (grammars), per row its logprobs where
        asked; None elsewhere. With call.fed_from (asynchronous scheduling, engine/runner/step_tokens.py) a row's
        input token is the previous step's (a DecodeAhead) on the device."""
        logits = self._decode_logits(call)                                   # [B, V] fp32
        return sampled_result(logits, call.sampling, call.host_rows) if self.rank == 0 else None

    @torch.inference_mode()
    def decode_ahead(self, call: DecodeAhead) -> "PendingTokens | None":
        """As decode, but the step's tokens stay on the device for the next step: worker 0 returns
        PendingTokens at once (their logprobs with them; no host rows)."""
        return self.fed_tokens.keep(self._decode_logits(call), call.sampling)

    def _decode_logits(self, call: Decode) -> torch.Tensor:
        """The step's forward (a CUDA graph where one fits) -> logits [B, V] fp32 on the device."""
        step_inputs = self.cache.place_decode_tokens(call)                                          # [5, B]
        fed = None if call.fed_from is None else self.fed_tokens.rows(call.fed_from)
        if self.graphs is not None and self.graphs.fits(len(call.seq_ids)):
            return self.graphs.run(step_inputs, fed)
        return self._decode_eager(step_inputs, max(len(self.pool.pages[s]) for s in call.seq_ids), fed)

    def decode_forward(self, step_inputs: torch.Tensor, num_pages: int | None = None) -> torch.Tensor:
        """step_inputs [5, B] int64 on the device -> logits [B, V] fp32 on the device (every worker). Captured
        by DecodeGraphs with static inputs; num_pages: the block table's width (None: the pool's maximum)."""
        self.decode_attention.begin_step(step_inputs, num_pages)
        hidden = self.model.forward(step_inputs[0], step_inputs[1], self.decode_attention)   # [B, hidden]
        return self.model.logits(hidden)

    def _decode_eager(self, step_inputs: torch.Tensor, num_pages: int, fed=None) -> torch.Tensor:
        """step_inputs [5, B] (host); fed: (tokens, rows) on the device, the input tokens' source (see decode)."""
        inputs = host_to_device(step_inputs, self.device)
        if fed is not None:
            inputs[0] = fed[0].index_select(0, fed[1])
        return self.decode_forward(inputs, num_pages)

    def release_graphs(self) -> None:
        """Destroys the CUDA graphs before the process group is: a graph that captured an NCCL collective holds
        its communicator, which the group's destruction waits for (pytorch/pytorch#115388: a hang at shutdown)."""
        release_graphs(self.graphs, self.extend_graphs)
        self.graphs = self.extend_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.data_group)
        return x

    def _sync(self) -> None:
        """Waits for the work queued so far, but the host tier's copies: a store out of the GPU runs beside
        compute, and what reads a restore waits for it on the GPU (engine/pages/host_pool.py)."""
        if self.cache.host is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        else:
            synchronize(self.device)


def worker_facts(runner: ModelRunner) -> WorkerFacts:
    """What a worker reports of itself (engine/core/messages.py)."""
    return WorkerFacts(
        rank=runner.rank, device=str(runner.device), kernel=runner.backend.name, block_size=runner.block_size,
        kv_pages_per_worker=runner.pool.num_pages, placement=runner.strategy.placement, max_pages_per_seq=runner.pool.max_pages_per_seq,
        kv_cache_dtype="fp8" if runner.pool.fp8 else str(runner.dtype).removeprefix("torch."),
        kv_host_pages=runner.cache.host.num_pages if runner.cache.host else 0, cuda_graphs=runner.graphs is not None,
        mixed_graph_tokens=runner.extend_graphs.mixed_max_tokens if runner.extend_graphs is not None else 0,
        zero_sliced_max_tokens=runner.sliced_max_tokens, prefill_rows_max=runner.prefill_rows_max)


# What each call runs (engine/core/calls.py): the work on the runner, the cache's changes on its WorkerCache.
WORK = {Prefill: ModelRunner.prefill, Extend: ModelRunner.extend, ExtendAndDecode: ModelRunner.extend_and_decode,
        Decode: ModelRunner.decode, DecodeAhead: ModelRunner.decode_ahead}
CACHE_CHANGES = {Fork: WorkerCache.fork, Adopt: WorkerCache.adopt, Truncate: WorkerCache.truncate,
                 Retire: WorkerCache.retire, Reinstate: WorkerCache.reinstate, Free: WorkerCache.free,
                 Offload: WorkerCache.offload, Restore: WorkerCache.restore, HostFree: WorkerCache.host_free,
                 PumpStores: WorkerCache.pump_idle}

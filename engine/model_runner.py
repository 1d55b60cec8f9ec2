"""What one worker does: hold the model replica and its KV shard, run prefill and decode steps.

Every worker runs the same method with the same arguments (worker 0 broadcasts the call); the
logits come back on worker 0 only.
"""
import gc
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.cache.host_pool import STORE_IN_FLIGHT, HostPool
from engine.cache.ledger import KVLedger, pages_for
from engine.cache.page_planner import ExtendWay, PagePlanner
from engine.cache.page_pool import PagePool
from engine.cache.sizing import (activation_bytes_per_token, fp8_gather_bytes, kv_bytes_per_token, mlp_piece_bytes,
                                 pass_q_bytes, pool_tokens_on_cpu, pool_tokens_on_gpu, prefill_rows_reserved)
from engine.config import DTYPES, EngineConfig, ModelConfig
from engine.decode_attention import DecodeAttention, DecodeStep, all_gather
from engine.decode_graphs import DecodeGraphs
from engine.chunk_sizer import MIN_CHUNK
from engine.extend_attention import ExtendAttention
from engine.extend_graphs import MAX_TOKENS as EXTEND_GRAPH_MAX_TOKENS, ExtendGraphs
from engine.devices import host_to_device, synchronize
from engine.errors import ModelLoadError
from engine.model import hf_weight_shapes
from engine.parallel import PrefillContext, PrefillStrategy, get_strategy
from engine.parallel.exchange_time import ExchangeTime
from engine.parallel.pass_kv import block_bytes
from engine.parallel.ring import RingCommunicator
from engine.parallel.sharding import Shard, owner_of_position
from engine.parallel.weight_layout import global_rank
from engine.prompt_logprobs import as_entries
from engine.sampling import RowSampling, rows_logprobs, sample_rows, top_logprobs
from engine.calls import (Adopt, Decode, DecodeAhead, DecodeResult, Extend, ExtendAndDecode, Fork, Free, HostFree,
                          Offload, Prefill, PrefillResult, PumpStores, Reinstate, Restore, Retire, Truncate)
from engine.step_tokens import PendingTokens
from engine.weights import load_weights, random_weights, weight_bytes
from kernels.attention import select_backend
from kernels.kv_quant import SCALE_BYTES, is_fp8
from kernels.paged_attention import (FP8_GATHER_SEGMENT, fa4_available, guarded_table, paged_attention, prefix_runs,
                                     split_prefix_attention)

log = logging.getLogger(__name__)


def kv_view(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [n, Hkv, D] -> [n, 2, Hkv, D]: a view where v follows k in each row (as the qkv projection's
    output lays them out), else a stack. No ring sends it, so no copy is needed (a copy a layer is a
    measurable share of a short prefill)."""
    n, hkv, d = k.shape
    if (k.stride() == v.stride() and k.stride()[1:] == (d, 1)
            and v.data_ptr() == k.data_ptr() + hkv * d * k.element_size()):
        return k.as_strided((n, 2, hkv, d), (k.stride(0), hkv * d, d, 1))
    return torch.stack([k, v], dim=1)


@dataclass
class PlacedExtend:
    """Where an incremental prefill's new tokens went (ModelRunner._place_extend), on this worker."""
    way: ExtendWay                # LOCAL, WHOLE or RING (engine/extend_attention.py)
    shards: list                  # the new tokens over the workers (Shard, positions within the new tokens)
    positions: torch.Tensor       # [m] int64 (host): the rows this worker runs, within the new tokens
    cached: int                   # the sequence's tokens on this worker before them
    cached_all: list[int]         # ... on every worker, by rank
    host_slots: torch.Tensor      # [n_w] int64 (host): where this worker keeps new K/V (n_w = its shard's length)
    keeps: bool                   # it keeps some of them

    @property
    def shards_tokens(self) -> int:
        return sum(s.length for s in self.shards)


class AfterRestore:
    """An extend's attention whose layer i first makes the compute stream wait for layer i's copies of a
    restore from the host tier (engine/cache/host_pool.py): the copy of later layers hides under the compute
    of earlier ones. Otherwise the attention it wraps (its attributes too)."""

    def __init__(self, attend, layer_waits: list):
        self.attend, self.layer_waits = attend, layer_waits

    def __call__(self, layer: int, q, k, v):
        torch.cuda.current_stream().wait_event(self.layer_waits[layer])
        return self.attend(layer, q, k, v)

    def __getattr__(self, name):
        return getattr(self.attend, name)


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
        self._check_weights_fit(weight_bytes(shapes, dtype.itemsize, slices), device)
        if engine.is_preset:
            weights = random_weights(shapes, device, dtype, engine.seed, slices)
        else:
            weights = load_weights(engine.model, list(shapes), device, dtype, slices)
        self.layout = self.strategy.weight_layout(cfg, rank, device, data_group)   # what follows from the weights
        self.model = self.layout.build_model(weights, self._all_reduce, engine.quantization, engine.kv_cache_dtype)
        self.whole_layers = self.layout.whole_layers   # a prefill's layers gathered whole (burst-zero), or None
        attn = self.layout.attn_cfg                    # the heads a prefill attends with and the K/V cache holds
        self.backend = select_backend(device, dtype, attn.num_heads, attn.num_kv_heads, cfg.head_dim, engine.kernel)
        self.scale = cfg.head_dim ** -0.5
        multi_ring = self.strategy.kv_workers > 1   # K/V spread over several workers (a ring, even if unused)
        self.ring = RingCommunicator(rank, self.world_size, device, data_group) if multi_ring else None
        self.kv_fp8 = is_fp8(engine.kv_cache_dtype)
        self.prefill_context = PrefillContext(self.backend, self.scale, self.ring, engine.overlap, data_group,
                                              cfg.num_heads, engine.auto_ulysses_max_tokens, self.kv_fp8)
        note = self.strategy.fallback_note(cfg.num_heads)
        if note and rank == 0:
            log.warning("%s", note)
        self.dtype, self.attn_cfg = dtype, attn
        self.block_size = engine.page_size
        self.max_model_len = max_model_len
        num_pages = self._num_pages()
        share = self.strategy.kv_share(max_model_len)   # a worker's share of the longest sequence
        self.pool = PagePool(cfg.num_layers, num_pages, self.block_size, attn.num_kv_heads, cfg.head_dim, dtype,
                             device, max_seqs=engine.max_num_seqs + 1,
                             max_pages_per_seq=min(num_pages, pages_for(share, self.block_size)),
                             kv_cache_dtype=engine.kv_cache_dtype)
        self.ledger = KVLedger(self.world_size, self.block_size, num_pages, replicated=self.strategy.replicated_kv)
        self.pages = PagePlanner(self.strategy, self.ledger, self.pool.max_pages_per_seq, engine.extend_ring_min_tokens)
        self.host_ledger, self.host = self._host_tier()   # --kv-offload-gb (engine/cache/host_pool.py), or None
        self.decode_attention = DecodeAttention(self.pool, self.scale, self.strategy.kv_workers, data_group)
        self.decode_attend = self.layout.decode_attention(self.decode_attention)   # (burst-zero: Helix's)
        # prompts this short run on the weight slices (burst-zero; else 0)
        self.sliced_max_tokens = self.layout.sliced_limit(engine.zero_sliced_max_tokens, share, self.prefill_context)
        self.graphs = DecodeGraphs.create(self, engine)    # None: eager decode (CPU, or no capturable kernel)
        # engine/step_tokens.py; a batch holds up to max_num_seqs + 1 (a short prompt beside one prefilled in chunks)
        self.fed_tokens = torch.zeros(engine.max_num_seqs + 1, dtype=torch.int64, device=device)
        self.extend_graphs = ExtendGraphs.create(self, engine)   # None: small extends run eagerly
        self._warm_extend_kernels()
        # the yardstick of hidden_fraction: a ring step's time alone, timed once here (collective), for the
        # block the ring sends (FP8 pages: FP8 bytes and a scale a row)
        message = ((2, attn.num_kv_heads, cfg.head_dim + SCALE_BYTES), torch.uint8) if self.kv_fp8 else \
            ((2, attn.num_kv_heads, cfg.head_dim), dtype)
        self.exchange_time = (ExchangeTime.measure(self.ring, self.world_size, rank, *message, device)
                              if self.ring is not None else None)
        log.info("worker %d: KV pool of %d pages x %d tokens (%.2f GiB, %s), decode %s", rank, num_pages,
                 self.block_size, self.pool.bytes() / 2**30,
                 "FP8 with a scale per token and head" if self.pool.fp8 else str(dtype).removeprefix("torch."),
                 "in CUDA graphs" if self.graphs else "eager")

    @torch.inference_mode()
    def prefill(self, call: Prefill) -> PrefillResult:
        """call.token_ids [N] int64 (CPU). Returns timings, and on worker 0 the logits [V] (CPU fp32) and with
        `prompt_logprobs` (top k) one entry per prompt position (see engine/prompt_logprobs.py)."""
        entered = time.perf_counter()
        seq_id, token_ids, prompt_logprobs = call.seq_id, call.token_ids, call.prompt_logprobs
        num_tokens = token_ids.shape[0]
        shards = self.strategy.shards(num_tokens)
        if prompt_logprobs is None and num_tokens <= self.sliced_max_tokens:   # on the weight slices (burst-zero)
            start, _, slots = self._begin_prefill(seq_id, shards)
            logits = self.layout.prefill_on_slices(self.prefill_context, self.pool, slots, shards, token_ids)   # [V]
            return self._prefill_result(self.layout.sliced_name, logits, start, entered)
        chosen = self.strategy.for_prompt(num_tokens, self.prefill_context)   # auto: ulysses or burst
        attention = chosen.attention(self.prefill_context, shards, self.rank)   # (q, kv, between) -> [n, H, D]
        exchange_alone = self._exchange_seconds_alone(chosen, shards)      # arithmetic (ExchangeTime)
        start, shard, slots = self._begin_prefill(seq_id, shards)           # slots [n]
        n, positions = shard.length, shard.positions()                      # [n]
        seq_parallel = chosen.sequence_parallel(num_tokens, self.rank, self.data_group)   # tp-v3
        local_ids = (seq_parallel.local_ids(token_ids) if seq_parallel else token_ids[positions]).to(self.device)
        if seq_parallel:                                                # every row, the padding's positions too
            positions = torch.arange(seq_parallel.padded)

        def attend(layer, q, k, v):                                     # q [n, H, D], k, v [n, Hkv, D]
            kv = torch.stack([k, v], dim=1) if self.ring is not None else kv_view(k, v)   # [n, 2, Hkv, D]
            store = lambda: self.pool.write(layer, slots, k[:n], v[:n])   # noqa: E731  (tp-v3: not the padding's)
            return attention(q, kv, store)                               # (a ring sends kv: contiguous)

        hidden = self.model.forward(local_ids, positions.to(self.device), attend, seq_parallel,
                                    self.whole_layers)                                       # [n, hidden]
        last = seq_parallel.last_row() if seq_parallel else owner_of_position(shards, num_tokens - 1)
        logits = self.layout.logits_of_row(hidden, *last)                  # [V], on every worker
        stats = self.ring.collect_stats() if self.ring else None
        result = self._prefill_result(chosen.name, logits, start, entered, stats, exchange_alone)
        if prompt_logprobs is not None:                                 # its time counts in wrapup_seconds
            wrapup = time.perf_counter()
            if seq_parallel:                                            # every row on every worker, as tp
                hidden, positions = seq_parallel.gather(hidden)[:n], positions[:n]
            parts = self.layout.prompt_scores(hidden, positions, token_ids, prompt_logprobs, self.strategy.replicated_kv)
            if self.rank == 0:
                result.prompt_logprobs = as_entries(parts, token_ids)
            result.wrapup_seconds += time.perf_counter() - wrapup
        return result

    def _begin_prefill(self, seq_id: int, shards: list[Shard]) -> tuple[float, Shard, torch.Tensor]:
        """A prefill's start (every worker's queue drained, the peak memory counted from here) and its prompt
        placed (the ledger, this worker's pages) -> (start time, this worker's Shard, its slots [n])."""
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)   # the peak of this prefill alone
        start = time.perf_counter()
        shard = self.strategy.shard_of(shards, self.rank)
        self.ledger.add(seq_id, self.pages.tokens_per_rank(shards), self.pages.ranges(shards, 0))
        self.pool.add(seq_id, shard.length)
        return start, shard, self.pool.slots(seq_id, 0, shard.length)

    def _prefill_result(self, strategy: str, logits: torch.Tensor, start: float, entered: float, stats=None,
                        exchange_alone: float = 0.0) -> PrefillResult:
        """After a prefill's forward: its timings (stats: the K/V ring's, against its exchanges' time alone), the
        workers' peak memory, and on worker 0 the logits [V] (CPU)."""
        self._sync()
        end = time.perf_counter()
        result = PrefillResult(end - start, strategy, setup_seconds=start - entered)
        if stats is not None:
            result.exposed_seconds, result.exchange_overlapped_seconds = stats.exposed_seconds, stats.exchange_seconds
        if stats is not None and exchange_alone > 0:   # hidden: share of the exchanges' time alone that compute covered
            share = 1.0 - stats.exposed_seconds / exchange_alone
            result.exchange_seconds, result.hidden_fraction = exchange_alone, min(1.0, max(0.0, share))
        if self.device.type == "cuda":
            result.peak_memory_bytes = self._peak_memory_all_workers()
        if self.rank == 0:
            result.logits = logits.cpu()
        result.wrapup_seconds = time.perf_counter() - end   # stats and logits after the prefill
        return result

    @torch.inference_mode()
    def extend(self, call: Extend) -> PrefillResult:
        """An incremental prefill: token_ids [n] int64 (CPU) are the sequence's tokens start .. start+n-1,
        after the `start` already in the cache (a chunked prefill's next chunk, or a prompt beyond its
        cached prefix), in one of three ways (engine/extend_attention.py, chosen by engine/cache/page_planner.py): "local"
        (one worker, or replicated K/V), "whole" (every worker runs the n tokens, one keeps their K/V) or
        "ring" (sharded over the workers, the K/V ring among them, their queries passed to the cache).
        Returns timings, and on worker 0 the logits [V] of the last token (CPU fp32)."""
        seq_id, token_ids, start = call.seq_id, call.token_ids, call.start
        self._sync()
        start_time = time.perf_counter()
        waits = self.host.layer_waits(seq_id) if self.host is not None else None   # a restore still copying
        placed = self._place_extend(seq_id, token_ids.shape[0], start)
        if self._graphed_extend(placed):
            self._wait_restore(waits)
            logits, _ = self.extend_graphs.run(token_ids, start, placed.host_slots if placed.keeps else None,
                                               self.pool.rows[seq_id], placed.cached)   # [V], on every worker
            return self._restored(seq_id, self._extend_result(logits, start, start_time, "extend", placed.way,
                                                              graphed=True))
        last, ids, positions, attend = self._begin_extend(seq_id, token_ids, start, placed, waits)
        attention, whole_layers = self.layout.extend_attention(attend)   # burst-zero: "whole" on the slices, as decode
        hidden = self.model.forward(ids, positions, attention, whole_layers=whole_layers)   # [m, hidden]
        logits = self.layout.logits_of_row(hidden, *last)                          # [V], on every worker
        return self._restored(seq_id, self._extend_result(logits, start, start_time, "extend", attend.reported_way))

    @torch.inference_mode()
    def extend_and_decode(self, call: ExtendAndDecode) -> PrefillResult:
        """A chunk of a prompt (as `extend`) and one decode step of other sequences (as `decode`) in one
        forward pass (Sarathi's mixed batch): each worker's rows are its share of the chunk followed by the
        B decode tokens, so the weights are read once for both; per layer the chunk's rows attend through
        ExtendAttention and the decode rows through DecodeAttention: one CUDA graph replay where
        engine/extend_graphs.py has one for the chunk's size and way and the batch, else eagerly. Returns
        `extend`'s result, and on worker 0 in its `decode` what `decode` returns."""
        seq_id, token_ids, start = call.extend.seq_id, call.extend.token_ids, call.extend.start
        step = call.decode
        seq_ids, decode_tokens, decode_positions = step.seq_ids, step.token_ids, step.positions
        self._sync()
        start_time = time.perf_counter()
        waits = self.host.layer_waits(seq_id) if self.host is not None else None   # a restore still copying
        step_pages = self.ledger.step_new_pages(seq_ids)                 # the decode rows' pages, taken after
        placed = self._place_extend(seq_id, token_ids.shape[0], start, step_pages)
        if self._graphed_extend(placed, len(seq_ids)):
            self._wait_restore(waits)
            step_inputs = self._place_decode_tokens(seq_ids, decode_tokens, decode_positions)   # [5, B] (host)
            logits, decode_logits = self.extend_graphs.run(token_ids, start, placed.host_slots if placed.keeps else None,
                                                           self.pool.rows[seq_id], placed.cached, step_inputs)
            result = self._restored(seq_id, self._extend_result(logits, start, start_time, "extend+decode", placed.way,
                                                                graphed=True))
            if self.rank == 0:
                result.decode = self._sampled(decode_logits, step)
            return result
        last, ids, positions, chunk = self._begin_extend(seq_id, token_ids, start, placed, waits)
        step_inputs = self._place_decode_tokens(seq_ids, decode_tokens, decode_positions).to(self.device)   # [5, B]
        self._begin_decode_step(step_inputs, max(len(self.pool.pages[s]) for s in seq_ids))
        m = ids.shape[0]

        def attend(layer, q, k, v):                                     # rows: m of the chunk, then B decode
            return torch.cat([chunk(layer, q[:m], k[:m], v[:m]), self.decode_attention(layer, q[m:], k[m:], v[m:])])

        hidden = self.model.forward(torch.cat([ids, step_inputs[0]]), torch.cat([positions, step_inputs[1]]), attend)
        logits = self.layout.logits_of_row(hidden[:m], *last)                      # [V], on every worker
        decode_logits = self.model.logits(hidden[m:])                               # [B, V]
        result = self._restored(seq_id, self._extend_result(logits, start, start_time, "extend+decode",
                                                            chunk.reported_way))
        if self.rank == 0:
            result.decode = self._sampled(decode_logits, step)
        return result

    def _place_extend(self, seq_id: int, num_tokens: int, start: int, reserved: list[int] | None = None) -> "PlacedExtend":
        """Places num_tokens new tokens after the sequence's `start` cached ones (its way, the ledger, this
        worker's pages). reserved: pages per worker a decode step in the same call takes (see PagePlanner.extend_way)."""
        held = self.ledger.seqs[seq_id].tokens
        way = self.pages.extend_way(num_tokens, held, reserved)
        shards = self.pages.extend_shards(held, num_tokens, way)
        shard = self.strategy.shard_of(shards, self.rank)
        positions = torch.arange(num_tokens) if way == ExtendWay.WHOLE else shard.positions()   # [m], of the new tokens
        cached, cached_all = self.ledger.tokens(seq_id, self.rank), list(held)
        self.ledger.extend(seq_id, self.pages.tokens_per_rank(shards), self.pages.ranges(shards, start))
        host_slots = self.pool.extend(seq_id, shard.length)             # [n_w]: the K/V this worker keeps
        return PlacedExtend(way, shards, positions, cached, cached_all, host_slots, keeps=shard.length > 0)

    def _graphed_extend(self, placed: "PlacedExtend", decode_rows: int = 0) -> bool:
        """Whether an extend so placed (with a decode step of decode_rows sequences) replays a CUDA graph
        (engine/extend_graphs.py): its way runs every new token on every worker in order ("whole", or "local"
        on one worker or tp), and a graph is that large. The same answer on every worker (their ledgers agree)."""
        n = placed.shards_tokens
        return (self.extend_graphs is not None and self.extend_graphs.fits(n, decode_rows) and placed.way != ExtendWay.RING
                and placed.positions.shape[0] == n and bool((placed.positions == torch.arange(n)).all()))

    def _begin_extend(self, seq_id: int, token_ids: torch.Tensor, start: int, placed: "PlacedExtend",
                      restore_waits: list | None = None):
        """An eager extend of the n new tokens `placed` put after the sequence's `start` cached ones ->
        ((worker, row) whose hidden state is the last token's, the rows this worker runs: token ids [m]
        and positions [m] on the device (its shard; "whole": all n), its ExtendAttention). restore_waits: the
        layer events of a restore from the host tier still copying, waited for layer by layer."""
        n = token_ids.shape[0]
        way, shards, positions = placed.way, placed.shards, placed.positions
        slots = placed.host_slots.to(self.device)
        attend = ExtendAttention(self.pool, seq_id, placed.cached, slots, shards, self.rank, self.backend, self.scale,
                                 self.ring, self.engine.overlap, self.data_group, way, self.kv_fp8,
                                 placed.cached_all if self._passes_kv(placed) else None)
        if restore_waits:
            attend = AfterRestore(attend, restore_waits)
        last = (0, n - 1) if way == ExtendWay.WHOLE else owner_of_position(shards, n - 1)
        return last, token_ids[positions].to(self.device), (positions + start).to(self.device), attend

    def _passes_kv(self, placed: "PlacedExtend") -> bool:
        """Does a "ring" extend pass the cached K/V around the ring (engine/parallel/pass_kv.py) rather than
        its queries to them? With --extend-pass kv on bf16 pages, where the blocks fit what the pool left for
        a chunk's pass-Q (on a GPU; a CPU worker's memory is taken as used). The same answer on every worker."""
        if placed.way != ExtendWay.RING or self.engine.extend_pass != "kv" or self.kv_fp8:
            return False
        need = block_bytes(placed.cached_all, placed.shards, self.attn_cfg.num_kv_heads, self.cfg.head_dim,
                           self.dtype.itemsize, self.block_size)
        fits = self.device.type != "cuda" or need <= self.pass_q_reserve_bytes
        if not fits and not self._logged_pass_kv_fallback:
            self._logged_pass_kv_fallback = True
            log.info("worker %d: --extend-pass kv: an extend's K/V blocks (%.1f GiB) do not fit the %.1f GiB reserved "
                     "for a chunk's pass-Q (none without chunked prefill, --kv-cache-tokens or flash-attn-4): it "
                     "passes Q (logged once)", self.rank, need / 2**30, self.pass_q_reserve_bytes / 2**30)
        return fits

    def _extend_result(self, logits: torch.Tensor, start: int, start_time: float, strategy: str, way: str,
                       graphed: bool = False) -> PrefillResult:
        """After an incremental prefill's forward: its timings and way, and on worker 0 the logits (CPU)."""
        if self.ring is not None:
            self.ring.collect_stats()                                    # not reported: a chunk's ring is short
        self._sync()
        result = PrefillResult(time.perf_counter() - start_time, strategy, cached_tokens=start, extend_way=way,
                               graphed=graphed)
        if self.rank == 0:
            result.logits = logits.cpu()
        return result

    @torch.inference_mode()
    def decode(self, call: Decode) -> DecodeResult | None:
        """One new token per sequence. On worker 0: every row's token (the argmax, or drawn on the device
        by its RowSampling), the logits of the rows the host samples (grammars), per row its logprobs where
        asked; None elsewhere. With call.fed_from (asynchronous scheduling, engine/step_tokens.py) a row's
        input token is the previous step's (a DecodeAhead) on the device."""
        logits = self._decode_logits(call)                                   # [B, V] fp32
        return self._sampled(logits, call) if self.rank == 0 else None

    @torch.inference_mode()
    def decode_ahead(self, call: DecodeAhead) -> "PendingTokens | None":
        """As decode, but the step's tokens stay on the device for the next step: worker 0 returns
        PendingTokens at once (their logprobs with them; no host rows)."""
        return self._keep_tokens(self._decode_logits(call), call.sampling)

    def _decode_logits(self, call: Decode) -> torch.Tensor:
        """The step's forward (a CUDA graph where one fits) -> logits [B, V] fp32 on the device."""
        step_inputs = self._place_decode_tokens(call.seq_ids, call.token_ids, call.positions)   # [5, B] int64, host
        fed = (None if call.fed_from is None else
               (self.fed_tokens, host_to_device(torch.tensor(call.fed_from), self.device)))
        if self.graphs is not None and self.graphs.fits(len(call.seq_ids)):
            return self.graphs.run(step_inputs, fed)
        return self._decode_eager(step_inputs, max(len(self.pool.pages[s]) for s in call.seq_ids), fed)

    def _keep_tokens(self, logits: torch.Tensor, sampling: "list[RowSampling] | None") -> "PendingTokens | None":
        """A step's tokens [B] (worker 0 samples them from logits [B, V]) into every worker's fed_tokens, with
        no host synchronization -> on worker 0 their host copy, pending."""
        b = logits.shape[0]
        kept = self.fed_tokens[:b]
        logprobs = None
        if self.rank == 0:
            tokens = sample_rows(logits, sampling)
            kept.copy_(tokens)
            rows = [i for i, r in enumerate(sampling or []) if r.logprobs is not None]
            if rows:
                tops = [sampling[i].logprobs for i in rows]
                index = host_to_device(torch.tensor(rows), self.device)
                logprobs = (rows, tops, *top_logprobs(logits.index_select(0, index), tokens.index_select(0, index),
                                                       max(tops)))
        if self.world_size > 1:
            dist.broadcast(kept, src=global_rank(0, self.data_group), group=self.data_group)
        return PendingTokens(kept, logprobs) if self.rank == 0 else None

    def _sampled(self, logits: torch.Tensor, call: Decode) -> DecodeResult:
        """A decode step's logits [B, V] fp32 -> what `decode` returns on worker 0."""
        sampling, host_rows = call.sampling, call.host_rows
        tokens = sample_rows(logits, sampling)                               # [B] on the device
        logprobs = None
        wanted = [i for i, r in enumerate(sampling or []) if r.logprobs is not None and i not in host_rows]
        if wanted:
            rows = torch.tensor(wanted, device=logits.device)
            entries = rows_logprobs(logits[rows], tokens[rows], [sampling[i].logprobs for i in wanted])
            logprobs = [None] * len(call.seq_ids)
            for i, entry in zip(wanted, entries):
                logprobs[i] = entry
        return DecodeResult(tokens.tolist(), logits[host_rows].cpu() if host_rows else logits[:0].cpu(), logprobs)

    def _place_decode_tokens(self, seq_ids: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Advances the ledger and this worker's pages by one token per sequence -> [5, B] int64: tokens,
        positions, slots (scratch where another worker stores the token), keys held here, table rows."""
        slots, lens, rows = [], [], []
        for s in seq_ids:
            if self.rank in self.ledger.advance(s):
                slots.append(self.pool.append(s))
            else:
                slots.append(0)                                             # page 0: scratch
            lens.append(self.pool.lengths[s])
            rows.append(self.pool.rows[s])
        return torch.tensor([token_ids, positions, slots, lens, rows], dtype=torch.int64)

    def decode_forward(self, step_inputs: torch.Tensor, num_pages: int | None = None) -> torch.Tensor:
        """step_inputs [5, B] int64 on the device -> logits [B, V] fp32 on the device (every worker). Captured
        by DecodeGraphs with static inputs; num_pages: the block table's width (None: the pool's maximum)."""
        self._begin_decode_step(step_inputs, num_pages)
        hidden = self.model.forward(step_inputs[0], step_inputs[1], self.decode_attend)   # [B, hidden]
        return self.model.logits(hidden)

    def _begin_decode_step(self, step_inputs: torch.Tensor, num_pages: int | None) -> None:
        """The decode attention's tensors for this step, from step_inputs [5, B] on the device."""
        tokens, positions, slots, lens, rows = step_inputs
        b = tokens.shape[0]
        pages = self.pool.table if num_pages is None else self.pool.table[:, :num_pages]
        # gathered behind one spare entry (kernels.paged_attention.guarded_table: flash-attn-4 reads the
        # entry before a row without keys), once for every layer of the step
        buf = torch.empty(1 + b * pages.shape[1], dtype=torch.int32, device=tokens.device)
        table = torch.index_select(pages, 0, rows, out=buf[1:].view(b, pages.shape[1]))   # [B, pages] int32
        cu = torch.arange(b + 1, dtype=torch.int32, device=tokens.device)
        self.decode_attention.step = DecodeStep(slots, table, lens.to(torch.int32), cu)

    def _decode_eager(self, step_inputs: torch.Tensor, num_pages: int, fed=None) -> torch.Tensor:
        """step_inputs [5, B] (host); fed: (tokens, rows) on the device, the input tokens' source (see decode)."""
        inputs = host_to_device(step_inputs, self.device)
        if fed is not None:
            inputs[0] = fed[0].index_select(0, fed[1])
        return self.decode_forward(inputs, num_pages)

    def _exchange_seconds_alone(self, chosen: PrefillStrategy, shards) -> float:
        """All layers' ring exchanges alone for this prompt, from the fit made at start; 0 without a K/V ring."""
        if self.exchange_time is None or not chosen.times_exchanges:
            return 0.0
        return self.exchange_time.layer_seconds([s.length for s in shards]) * self.cfg.num_layers

    @torch.inference_mode()
    def fork(self, call: Fork) -> None:
        """A new sequence whose cache starts as a copy of the source's prompt K/V (the prompt's tokens
        fill each worker's first slots; what the source decoded since is not copied)."""
        source_id, seq_id = call.source_id, call.seq_id
        counts = self.ledger.prompt_tokens(source_id)
        self.ledger.add(seq_id, counts, self.ledger.prompt_ranges(source_id))
        self.pool.copy_prefix(source_id, seq_id, counts[self.rank])

    @torch.inference_mode()
    def adopt(self, call: Adopt) -> None:
        """A new sequence whose cache starts as a copy of the source's tokens before `position` (a
        cached prefix: on every worker, the source's first slots there, whole pages copied)."""
        counts = self.ledger.add_prefix_of(call.source_id, call.seq_id, call.position)
        self.pool.copy_prefix(call.source_id, call.seq_id, counts[self.rank])

    @torch.inference_mode()
    def offload(self, call: Offload) -> int:
        """A host entry of the sequence's id: a copy of its tokens before `position` (every worker its own
        first slots) -> the bytes this worker copies."""
        counts = self.host_ledger.add_prefix_of(call.seq_id, call.seq_id, call.position, tier=self.ledger)
        return self.host.store(self.pool, call.seq_id, call.seq_id, counts[self.rank])

    @torch.inference_mode()
    def restore(self, call: Restore) -> int:
        """A new sequence whose cache starts as a copy of the host entry's tokens before `position` (on every
        worker, the entry's first slots there, whole pages copied) -> the bytes this worker copies."""
        counts = self.ledger.add_prefix_of(call.host_id, call.seq_id, call.position, tier=self.host_ledger)
        self.pool.add(call.seq_id, counts[self.rank])
        return self.host.load(self.pool, call.host_id, call.seq_id, counts[self.rank])

    def pump_stores(self) -> None:
        """Issues the next STORE_IN_FLIGHT bytes of the host tier's queued stores (before every call)."""
        if self.host is not None and self.host.queued:
            self.host.pump(STORE_IN_FLIGHT)

    def pump_idle(self, call: PumpStores) -> None:
        """The engine is idle: the next slice of the queued stores (pump_stores, which every call runs first)."""
        self.pump_stores()

    def host_free(self, call: HostFree) -> None:
        for h in call.host_ids:
            self.host.free(h)
            self.host_ledger.remove(h)

    def retire(self, call: Retire) -> None:
        """These sequences stop decoding and stay in the cache (prefix-cache entries: copied from, freed later)."""
        for s in call.seq_ids:
            self.pool.retire(s)

    def truncate(self, call: Truncate) -> None:
        """A prefix-cache entry keeps only its tokens before `position` (its tail's pages freed on every worker)."""
        self._pages_unused(call.seq_id)
        self.pool.truncate(call.seq_id, self.ledger.truncate(call.seq_id, call.position)[self.rank])

    def reinstate(self, call: Reinstate) -> None:
        """Retired sequences decode again on the pages they kept (a preempted sequence's entry taken back)."""
        for s in call.seq_ids:
            self.pool.reinstate(s)

    def free(self, call: Free) -> None:
        for s in call.seq_ids:
            self._pages_unused(s)
            self.pool.free(s)
            self.ledger.remove(s)

    @staticmethod
    def _wait_restore(waits: list | None) -> None:
        """The compute stream waits for the whole of a restore still copying (a graph replays every layer)."""
        if waits:
            torch.cuda.current_stream().wait_event(waits[-1])

    def _pages_unused(self, seq_id: int) -> None:
        """Before the sequence's pages go back to the pool: the compute stream waits for the host tier's copies
        out of them or into them (whoever takes them next writes them)."""
        if self.host is not None:
            self.host.pages_unused(seq_id)

    def _restored(self, seq_id: int, result: PrefillResult) -> PrefillResult:
        """An extend's result, with the restore from the host tier that preceded it (its copy's seconds and bytes)."""
        done = self.host.restore_seconds(seq_id) if self.host is not None else None
        if done is not None:
            result.restore_seconds, result.restored_bytes = done
        return result

    def release_graphs(self) -> None:
        """Destroys the decode and extend CUDA graphs; called before the process group is destroyed. A
        graph that captured an NCCL collective holds a reference to its communicator, and destroying the
        group waits for every such reference (pytorch/pytorch#115388): with the graphs alive, a worker of
        several GPUs would hang at shutdown."""
        for holder in (self.graphs, self.extend_graphs):
            if holder is not None:
                for graph in holder.graphs.values():
                    graph.reset()
                holder.graphs.clear()
                holder.outputs.clear()
        self.graphs = self.extend_graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def info(self) -> dict:
        per_worker = self.ledger.num_pages * self.block_size
        total = per_worker * self.strategy.kv_workers   # replicated K/V (tp): every worker holds every token
        return {"rank": self.rank, "device": str(self.device), "kernel": self.backend.name,
                "kv_capacity_tokens": per_worker, "kv_capacity_total": total, "block_size": self.block_size,
                "kv_cache_dtype": "fp8" if self.pool.fp8 else str(self.dtype).removeprefix("torch."),
                "kv_pages_per_worker": self.ledger.num_pages, "cuda_graphs": self.graphs is not None,
                "zero_sliced_max_tokens": self.sliced_max_tokens, "prefill_rows_max": self.prefill_rows_max,
                "kv_host_capacity_tokens": self.host_ledger.num_pages * self.block_size if self.host else 0}

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.data_group)
        return x

    def _host_tier(self) -> "tuple[KVLedger | None, HostPool | None]":
        """The host-memory tier under the prefix cache: --kv-offload-gb GiB of pages shaped like the pool's (the
        fewest over the workers, so every worker's tier is the same size), and its ledger; (None, None) at 0."""
        gib = self.engine.kv_offload_gb
        if not gib:
            return None, None
        page_bytes = self.block_size * kv_bytes_per_token(self.cfg, self.attn_cfg.num_kv_heads, self.dtype.itemsize,
                                                          self.engine.kv_cache_dtype)
        agreed = torch.tensor([int(gib * 2**30) // page_bytes], dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.data_group)
        pages = int(agreed)
        if pages < 1:
            raise ModelLoadError(f"--kv-offload-gb {gib} holds no KV page (a page is {page_bytes / 2**20:.1f} MiB "
                                 f"on a worker): raise it, or 0 for no host tier")
        start = time.perf_counter()
        host = HostPool(self.pool, pages)
        log.info("worker %d: KV host tier of %d pages x %d tokens (%.2f GiB%s, %.1f s)", self.rank, pages,
                 self.block_size, host.bytes() / 2**30, ", pinned" if host.cuda else "", time.perf_counter() - start)
        return KVLedger(self.world_size, self.block_size, pages, replicated=self.strategy.replicated_kv), host

    def release_host_tier(self) -> None:
        """Unpins the host tier's memory (at shutdown)."""
        if self.host is not None:
            self.host.release()
            self.host = None

    def _num_pages(self) -> int:
        """Pages per worker: --kv-cache-tokens, else sized from memory (engine/cache/sizing.py); the
        smallest over the workers, so that every worker's pool is the same size."""
        kv_per_token = kv_bytes_per_token(self.cfg, self.attn_cfg.num_kv_heads, self.dtype.itemsize,
                                          self.engine.kv_cache_dtype)
        has_fa4 = int(self.device.type == "cuda" and fa4_available(self.device))
        self.prefill_rows_max = None               # no limit but the pool's (set below where memory is sized)
        self.pass_q_reserve_bytes = 0              # what a chunk's pass-Q may hold (set below likewise)
        self._logged_pass_kv_fallback = False
        if self.engine.kv_cache_tokens:
            tokens = self.engine.kv_cache_tokens
        elif self.device.type != "cuda":
            tokens = pool_tokens_on_cpu(kv_per_token)
        else:
            # the blocks freed while the weights were built (fused qkv and gate_up copied from their parts) go
            # back to the device first: held in torch's cache they would count as in use and shrink the pool
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # less what the layout leaves free (burst-zero: the layers and the embedding gathered whole)
            budget = int(self.engine.gpu_memory_utilization * total) - (total - free) - self.layout.reserve_bytes()
            share = self.strategy.kv_share(self.max_model_len)
            chunk = self.engine.max_num_batched_tokens
            self.prefill_rows_max = prefill_rows_reserved(share, chunk, self.engine.max_num_seqs,
                                                          EXTEND_GRAPH_MAX_TOKENS, gathers_context=not has_fa4)
            if chunk is not None and has_fa4 and self.strategy.kv_workers > 1:   # a sharded chunk passes its Q
                self.pass_q_reserve_bytes = pass_q_bytes(min(chunk, self.max_model_len), self.cfg.num_heads,
                                                         self.cfg.head_dim, self.dtype.itemsize)
                budget -= self.pass_q_reserve_bytes
            if self.kv_fp8 and self.engine.max_num_batched_tokens is not None:   # a chunk gathers its context
                gathered = min(share, FP8_GATHER_SEGMENT + self.engine.max_num_batched_tokens)
                budget -= fp8_gather_bytes(gathered, self.attn_cfg.num_kv_heads, self.cfg.head_dim, self.dtype.itemsize)
            budget -= mlp_piece_bytes(self.cfg, self.dtype.itemsize)
            tokens = pool_tokens_on_gpu(budget, kv_per_token, activation_bytes_per_token(self.cfg, self.dtype.itemsize),
                                        self.prefill_rows_max)
            log.info("worker %d: %.1f of %.1f GiB in use after weights (%.1f GiB of tensors); KV pool of %d tokens "
                     "(%.1f GiB) at gpu_memory_utilization %.2f, activations reserved for %d tokens in one call",
                     self.rank, (total - free) / 2**30, total / 2**30, torch.cuda.memory_allocated(self.device) / 2**30,
                     tokens, tokens * kv_per_token / 2**30,
                     self.engine.gpu_memory_utilization, self.prefill_rows_max)
        if tokens < self.block_size:
            raise ModelLoadError(f"worker {self.rank} ({self.device}) has no memory left for the KV cache "
                                 f"(room for {max(tokens, 0)} tokens, a page is {self.block_size}): raise "
                                 f"--gpu-memory-utilization (now {self.engine.gpu_memory_utilization}), lower "
                                 f"--max-model-len, or set --kv-cache-tokens")
        # one MIN over the workers: the pages, and flash-attn-4 on every worker (1) / on none (-1 negated)
        agreed = torch.tensor([tokens // self.block_size, has_fa4, -has_fa4], dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.data_group)
        pages, on_every, on_some = agreed.tolist()
        check_same_kernels(self.rank, self.device, bool(has_fa4), bool(on_every), bool(-on_some))
        return pages

    @torch.inference_mode()
    def _warm_extend_kernels(self) -> None:
        """Builds at start the flash-attn-4 kernels an incremental prefill uses in its "local" and "whole"
        ways (the causal paged call over cached + new keys, the unmasked one over cached keys, and a small
        late chunk's prefix runs with their causal call over the chunk), so that none is built under
        load: a kernel built on first use while streams decode stalls every one of them for the whole build
        (a second or more). Reads only the scratch page; the results are dropped. Each worker alone."""
        if self.device.type != "cuda" or not fa4_available(self.device) or self.kv_fp8:
            return
        m, h, hkv, d = MIN_CHUNK, self.attn_cfg.num_heads, self.attn_cfg.num_kv_heads, self.cfg.head_dim
        q = torch.randn(m, h, d, device=self.device, dtype=self.dtype)
        k, v = (torch.randn(m, hkv, d, device=self.device, dtype=self.dtype) for _ in range(2))
        pages = [0] * pages_for(2 * m, self.block_size)                      # the scratch page, 2 m keys' worth
        keys = len(pages) * self.block_size
        table = guarded_table(torch.tensor([pages], dtype=torch.int32, device=self.device))
        cu = torch.tensor([0, m], dtype=torch.int32, device=self.device)
        lens = torch.tensor([keys], dtype=torch.int32, device=self.device)
        for causal in (True, False):
            paged_attention(q, *self.pool.layer(0), table, cu, lens, self.scale, causal=causal,
                            rows_see_keys=True)
        runs = prefix_runs(pages, keys, self.block_size, m, 2, self.device)
        split_prefix_attention(q, k, v, *self.pool.layer(0), runs, self.scale, self.backend)
        self._sync()

    def _check_weights_fit(self, nbytes: int, device: torch.device) -> None:
        """Refuses, before allocating anything, weights larger than this GPU's share for the model
        (--gpu-memory-utilization of its memory), or, on CPU, than the host's memory over all its CPU
        workers, with the numbers."""
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            budget, where = self.engine.gpu_memory_utilization * total, f"{self.engine.gpu_memory_utilization:.2f} x"
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            budget, where = total / self.world_size, f"1/{self.world_size} of the host's"
        if nbytes > budget:
            raise ModelLoadError(
                f"worker {self.rank} ({device}) would hold {nbytes / 2**30:.1f} GiB of weights with "
                f"--sp-strategy {self.engine.sp_strategy} over {self.world_size} device(s), more than "
                f"{where} {total / 2**30:.1f} GiB = {budget / 2**30:.1f} GiB: use --sp-strategy tp or burst-zero "
                f"over more devices (they split the weights), or a smaller model")

    def _peak_memory_all_workers(self) -> int:
        """The largest peak of allocated GPU memory over the workers (bytes)."""
        peak = torch.tensor([torch.cuda.max_memory_allocated(self.device)], device=self.device)
        if self.world_size > 1:
            peak = all_gather(peak, self.world_size, self.data_group)
        return int(peak.max())

    def _sync(self) -> None:
        """Waits for the work queued so far, but the host tier's copies: a store out of the GPU runs beside
        compute, and what reads a restore waits for it on the GPU (engine/cache/host_pool.py)."""
        if self.host is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        else:
            synchronize(self.device)


def check_same_kernels(rank: int, device: torch.device, has_fa4: bool, fa4_on_every: bool, fa4_on_some: bool) -> None:
    """Refuses workers that differ in flash-attn-4: with it a worker captures CUDA graphs whose small
    extends make other collectives than the eager path of a worker without it, so the workers would wait on
    each other for ever at the first such extend. Every worker raises (one all-reduce told them all)."""
    if fa4_on_some and not fa4_on_every:
        where = "runs here but not on every worker" if has_fa4 else "does not run here but runs on other workers"
        raise ModelLoadError(f"worker {rank} ({device}): flash-attn-4 {where}; install the same "
                             "packages (pip install 'burstserve[flash-attn]') on every host, with GPUs of one kind "
                             "(SM90 or newer)")

"""What one worker does: hold the model replica and its KV shard, run prefill and decode steps.

Every worker runs the same method with the same arguments (worker 0 broadcasts the call); the
logits come back on worker 0 only.
"""
import logging
import time
from functools import partial

import torch
import torch.distributed as dist

from engine.burst_attention import BurstAttention
from engine.cache.ledger import KVLedger, pages_for
from engine.cache.page_pool import PagePool
from engine.cache.sizing import activation_bytes_per_token, kv_bytes_per_token, pool_tokens_on_cpu, pool_tokens_on_gpu
from engine.config import DTYPES, EngineConfig, ModelConfig
from engine.cqs import CQSAttention, contiguous_shards
from engine.decode_attention import DecodeAttention, DecodeStep, all_gather
from engine.decode_graphs import DecodeGraphs
from engine.devices import synchronize
from engine.errors import ModelLoadError
from engine.model import LlamaModel, hf_weight_shapes
from engine.prompt_logprobs import as_entries, gather_scores, score_rows
from engine.ring import RingCommunicator
from engine.ring_rsa import RingSelfAttention
from engine.sharding import owner_of_position, zigzag_shards
from engine.tensor_parallel import shard_weights
from engine.ulysses import UlyssesAttention
from engine.weights import load_weights, random_weights
from kernels.attention import AttentionBackend, reference_attention, select_backend

log = logging.getLogger(__name__)
# Prefill strategies (how attention spans the workers); decoding afterwards is the same for all.
SP_STRATEGIES = ("burst", "auto", "burst-nolao", "ring-rsa", "ulysses", "cqs", "tp", "single")
MATERIALIZED = AttentionBackend("materialized", partial(reference_attention, query_chunk=1 << 62))


class ModelRunner:
    def __init__(self, engine: EngineConfig, cfg: ModelConfig, rank: int, device: torch.device, data_group=None,
                 max_model_len: int = 1 << 20):
        self.engine, self.cfg, self.rank, self.device = engine, cfg, rank, device
        self.world_size = engine.world_size
        self.data_group = data_group
        dtype = DTYPES[engine.dtype]
        self.tp = engine.sp_strategy == "tp" and self.world_size > 1
        shapes = hf_weight_shapes(cfg)
        if engine.is_preset:
            weights = random_weights(shapes, device, dtype, engine.seed)
        else:
            weights = load_weights(engine.model, list(shapes), device, dtype)
        local = cfg
        if self.tp:   # each worker keeps its heads and MLP slice; all-reduce after o_proj and down_proj
            local, weights = shard_weights(cfg, weights, rank, self.world_size)
        self.model = LlamaModel(local, weights, device, reduce=self._all_reduce if self.tp else None)
        self.backend = select_backend(device, dtype, local.num_heads, local.num_kv_heads, cfg.head_dim, engine.kernel)
        self.scale = cfg.head_dim ** -0.5
        multi_ring = self.world_size > 1 and not self.tp
        self.ring = RingCommunicator(rank, self.world_size, device, data_group) if multi_ring else None
        self.dtype, self.local_cfg = dtype, local
        self.block_size = engine.page_size
        self.max_model_len = max_model_len
        num_pages = self._num_pages()
        # a worker's share of the longest sequence, in pages (zigzag shards differ by at most one token a chunk)
        share = max_model_len if self.tp else -(-max_model_len // self.world_size) + 1
        self.pool = PagePool(cfg.num_layers, num_pages, self.block_size, local.num_kv_heads, cfg.head_dim, dtype,
                             device, max_seqs=engine.max_num_seqs + 1,
                             max_pages_per_seq=min(num_pages, pages_for(share, self.block_size)))
        self.ledger = KVLedger(self.world_size, self.block_size, num_pages, replicated=self.tp)
        self.decode_attention = DecodeAttention(self.pool, self.scale, 1 if self.tp else self.world_size,
                                                data_group)
        self.graphs = DecodeGraphs.create(self, engine)    # None: eager decode (CPU, or no capturable kernel)
        self._exchange_alone: dict[int, float] = {}        # prompt length -> seconds of its exchanges alone
        log.info("worker %d: KV pool of %d pages x %d tokens (%.2f GiB), decode %s", rank, num_pages,
                 self.block_size, self.pool.bytes() / 2**30, "in CUDA graphs" if self.graphs else "eager")

    @torch.inference_mode()
    def prefill(self, seq_id: int, token_ids: torch.Tensor, prompt_logprobs: int | None = None) -> dict:
        """token_ids [N] int64 (CPU). Returns on worker 0: logits [V] (CPU fp32), timings, and with
        `prompt_logprobs` (top k) one entry per prompt position (see engine/prompt_logprobs.py)."""
        entered = time.perf_counter()
        shards = self._shards(token_ids.shape[0])
        strategy = self._strategy_for(token_ids.shape[0])
        attention = self._prefill_attention(shards, strategy)
        exchange_alone = self._exchange_seconds_alone(attention, token_ids.shape[0])   # first time per length only
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)   # the peak of this prefill alone
        start = time.perf_counter()
        shard = shards[0 if self.tp else self.rank]
        positions = shard.positions()                                   # [n]
        local_ids = token_ids[positions].to(self.device)
        self.ledger.add(seq_id, self._tokens_per_rank(shards))
        self.pool.add(seq_id, shard.length)
        slots = self.pool.slots(seq_id, 0, shard.length)               # [n]

        def attend(layer, q, k, v):                                     # q [n, H, D], k, v [n, Hkv, D]
            self.pool.write(layer, slots, k, v)
            return attention(q, torch.stack([k, v], dim=1))             # the ring's message: [n, 2, Hkv, D]

        hidden = self.model.forward(local_ids, positions.to(self.device), attend)   # [n, hidden]
        owner, row = owner_of_position(shards, token_ids.shape[0] - 1)  # tp: worker 0 (all hold every row)
        if self.rank == owner:
            logits = self.model.logits(hidden[row:row + 1])[0]           # [V]
        else:
            logits = torch.empty(self.cfg.vocab_size, dtype=torch.float32, device=self.device)
        if owner != 0:
            dist.broadcast(logits, src=owner, group=self.data_group)
        stats = self.ring.collect_stats() if self.ring else None
        self._sync()
        end = time.perf_counter()
        result = {"prefill_seconds": end - start, "strategy": strategy, "setup_seconds": start - entered}
        if stats is not None:
            result.update(exposed_seconds=stats.exposed_seconds, exchange_overlapped_seconds=stats.exchange_seconds)
        if stats is not None and exchange_alone > 0:   # hidden: share of the exchanges' time alone that compute covered
            share = 1.0 - stats.exposed_seconds / exchange_alone
            result.update(exchange_seconds=exchange_alone, hidden_fraction=min(1.0, max(0.0, share)))
        if self.device.type == "cuda":
            result["peak_memory_bytes"] = self._peak_memory_all_workers()
        if self.rank == 0:
            result["logits"] = logits.cpu()
        if prompt_logprobs is not None:
            entries = self._prompt_logprobs(hidden, positions, token_ids, prompt_logprobs)
            if self.rank == 0:
                result["prompt_logprobs"] = entries
        result["wrapup_seconds"] = time.perf_counter() - end   # stats, logits (and prompt logprobs) after the prefill
        return result

    def _prompt_logprobs(self, hidden, positions, token_ids, top: int) -> list | None:
        """Each worker scores the rows it holds (tp: worker 0 holds them all); worker 0 gets the entries."""
        if self.tp:
            parts = [score_rows(self.model, hidden, positions, token_ids, top)] if self.rank == 0 else []
        else:
            parts = gather_scores(score_rows(self.model, hidden, positions, token_ids, top), self.world_size,
                                  self.data_group)
        return as_entries(parts, token_ids) if self.rank == 0 else None

    @torch.inference_mode()
    def decode(self, seq_ids: list[int], token_ids: list[int], positions: list[int],
               full_rows: list[int] | None = None) -> tuple[list[int], torch.Tensor] | None:
        """One new token per sequence. On worker 0: (the greedy token of every row, logits [len(full_rows), V]
        CPU fp32 of the rows that sample otherwise or want logprobs); None elsewhere."""
        step_inputs = self._decode_inputs(seq_ids, token_ids, positions)   # [5, B] int64 on the host
        if self.graphs is not None and self.graphs.fits(len(seq_ids)):
            logits = self.graphs.run(step_inputs)                            # [B, V] fp32
        else:
            logits = self._decode_eager(step_inputs, max(len(self.pool.pages[s]) for s in seq_ids))
        if self.rank != 0:
            return None
        greedy = logits.argmax(dim=-1).tolist()
        rows = full_rows or []
        return greedy, (logits[rows].cpu() if rows else logits[:0].cpu())

    def _decode_inputs(self, seq_ids: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
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
        tokens, positions, slots, lens, rows = step_inputs
        b = tokens.shape[0]
        pages = self.pool.table if num_pages is None else self.pool.table[:, :num_pages]
        # gathered behind one spare entry (kernels.paged_attention.guarded_table: flash-attn-4 reads the
        # entry before a row without keys), once for every layer of the step
        buf = torch.empty(1 + b * pages.shape[1], dtype=torch.int32, device=tokens.device)
        table = torch.index_select(pages, 0, rows, out=buf[1:].view(b, pages.shape[1]))   # [B, pages] int32
        cu = torch.arange(b + 1, dtype=torch.int32, device=tokens.device)
        self.decode_attention.step = DecodeStep(slots, table, lens.to(torch.int32), cu)
        hidden = self.model.forward(tokens, positions, self.decode_attention)   # [B, hidden]
        return self.model.logits(hidden)

    def _decode_eager(self, step_inputs: torch.Tensor, num_pages: int) -> torch.Tensor:
        return self.decode_forward(step_inputs.to(self.device, non_blocking=True), num_pages)

    def _strategy_for(self, num_tokens: int) -> str:
        """The prefill strategy of one prompt: the configured one, or for `auto` ulysses on short
        prompts (it has no per-ring-step cost; measured 2x faster than burst at 4K on 4 H200s) and
        burst on long ones. Both keep the same zigzag KV layout, so decoding does not care."""
        strategy = self.engine.sp_strategy
        if strategy != "auto":
            return strategy
        short = num_tokens <= self.engine.auto_ulysses_max_tokens
        return "ulysses" if short and self.world_size > 1 and self.cfg.num_heads % self.world_size == 0 else "burst"

    def _prefill_attention(self, shards, strategy: str):
        """attention(q [n, H, D], kv [n, 2, Hkv, D]) -> out [n, H, D] for this prefill's strategy."""
        overlap = self.engine.overlap
        if self.tp:   # the whole prompt, this worker's heads: one causal kernel call
            return lambda q, kv: self.backend(q, kv[:, 0], kv[:, 1], True, self.scale)[0]
        if strategy == "ring-rsa":
            return RingSelfAttention(self.ring, shards, self.rank, self.scale, overlap)
        if strategy == "cqs":
            return CQSAttention(self.backend, shards, self.rank, self.scale, self.data_group)
        if strategy == "ulysses":
            return UlyssesAttention(self.backend, shards, self.rank, self.scale, self.data_group)
        backend = MATERIALIZED if strategy == "burst-nolao" else self.backend
        return BurstAttention(self.ring, backend, shards, self.rank, self.scale, overlap)

    def _exchange_seconds_alone(self, attention, num_tokens: int) -> float:
        """All layers' exchanges timed alone, once per prompt length (cached); 0 without a K/V ring."""
        if self.ring is None or not isinstance(attention, BurstAttention):
            return 0.0
        if num_tokens not in self._exchange_alone:
            if len(self._exchange_alone) > 64:
                self._exchange_alone.clear()
            shape = (2, self.cfg.num_kv_heads, self.cfg.head_dim)
            per_layer = attention.time_exchanges_alone(shape, self.dtype, self.device)
            self._exchange_alone[num_tokens] = per_layer * self.cfg.num_layers
        return self._exchange_alone[num_tokens]

    def _shards(self, num_tokens: int):
        shard_fn = contiguous_shards if self.engine.sp_strategy == "cqs" else zigzag_shards
        return shard_fn(num_tokens, 1 if self.tp else self.world_size)

    def _tokens_per_rank(self, shards) -> list[int]:
        return [s.length for s in shards] * (self.world_size if self.tp else 1)

    def prefill_pages(self, num_tokens: int) -> list[int]:
        """Pages each worker takes to prefill a prompt of num_tokens (for the scheduler's admission)."""
        return [pages_for(n, self.block_size) for n in self._tokens_per_rank(self._shards(num_tokens))]

    @torch.inference_mode()
    def fork(self, source_id: int, seq_id: int) -> None:
        """A new sequence whose cache starts as a copy of the source's prompt K/V (the prompt's tokens
        fill each worker's first slots; what the source decoded since is not copied)."""
        counts = self.ledger.prompt_tokens(source_id)
        self.ledger.add(seq_id, counts)
        self.pool.copy_prefix(source_id, seq_id, counts[self.rank])

    def free(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self.pool.free(s)
            self.ledger.remove(s)

    def info(self) -> dict:
        per_worker = self.ledger.num_pages * self.block_size
        total = per_worker * (1 if self.tp else self.world_size)   # tp: every worker holds every token
        return {"rank": self.rank, "device": str(self.device), "kernel": self.backend.name,
                "kv_capacity_tokens": per_worker, "kv_capacity_total": total, "block_size": self.block_size,
                "kv_pages_per_worker": self.ledger.num_pages, "cuda_graphs": self.graphs is not None}

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.data_group)
        return x

    def _num_pages(self) -> int:
        """Pages per worker: --kv-cache-tokens, else sized from memory (engine/cache/sizing.py); the
        smallest over the workers, so that every worker's pool is the same size."""
        kv_per_token = kv_bytes_per_token(self.cfg, self.local_cfg.num_kv_heads, self.dtype.itemsize)
        if self.engine.kv_cache_tokens:
            tokens = self.engine.kv_cache_tokens
        elif self.device.type != "cuda":
            tokens = pool_tokens_on_cpu(kv_per_token)
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(self.engine.gpu_memory_utilization * total) - (total - free)
            share = self.max_model_len if self.tp else -(-self.max_model_len // self.world_size) + 1
            tokens = pool_tokens_on_gpu(budget, kv_per_token, activation_bytes_per_token(self.cfg, self.dtype.itemsize),
                                        share)
            log.info("worker %d: %.1f of %.1f GiB in use after weights; KV pool of %d tokens (%.1f GiB) at "
                     "gpu_memory_utilization %.2f", self.rank, (total - free) / 2**30, total / 2**30, tokens,
                     tokens * kv_per_token / 2**30, self.engine.gpu_memory_utilization)
        if tokens < self.block_size:
            raise ModelLoadError(f"worker {self.rank} ({self.device}) has no memory left for the KV cache "
                                 f"(room for {max(tokens, 0)} tokens, a page is {self.block_size}): raise "
                                 f"--gpu-memory-utilization (now {self.engine.gpu_memory_utilization}), lower "
                                 f"--max-model-len, or set --kv-cache-tokens")
        pages = tokens // self.block_size
        pages = torch.tensor([pages], dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=self.data_group)
        return int(pages)

    def _peak_memory_all_workers(self) -> int:
        """The largest peak of allocated GPU memory over the workers (bytes)."""
        peak = torch.tensor([torch.cuda.max_memory_allocated(self.device)], device=self.device)
        if self.world_size > 1:
            peak = all_gather(peak, self.world_size, self.data_group)
        return int(peak.max())

    def _sync(self) -> None:
        synchronize(self.device)

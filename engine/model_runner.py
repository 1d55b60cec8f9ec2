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
from engine.config import CPU_KV_TOKENS, DTYPES, EngineConfig, ModelConfig
from engine.cqs import CQSAttention, contiguous_shards
from engine.decode_attention import DecodeAttention, all_gather
from engine.devices import synchronize
from engine.kv_cache import KVCache, next_kv_owner
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
    def __init__(self, engine: EngineConfig, cfg: ModelConfig, rank: int, device: torch.device, data_group=None):
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
        self.kv = KVCache(cfg.num_layers, local.num_kv_heads, cfg.head_dim, dtype, device)
        self.decode_attention = DecodeAttention(self.backend, self.scale, 1 if self.tp else self.world_size,
                                                data_group)
        self.tokens_per_rank: dict[int, list[int]] = {}   # seq_id -> tokens each worker holds (same everywhere)
        self.prompt_tokens_per_rank: dict[int, list[int]] = {}   # seq_id -> of those, the prompt's (first slots)
        self._exchange_alone: dict[int, float] = {}        # prompt length -> seconds of its exchanges alone
        self.kv_capacity_tokens = self._kv_capacity()

    @torch.inference_mode()
    def prefill(self, seq_id: int, token_ids: torch.Tensor, reserve: int, prompt_logprobs: int | None = None) -> dict:
        """token_ids [N] int64 (CPU). Returns on worker 0: logits [V] (CPU fp32), timings, and with
        `prompt_logprobs` (top k) one entry per prompt position (see engine/prompt_logprobs.py)."""
        entered = time.perf_counter()
        shard_fn = contiguous_shards if self.engine.sp_strategy == "cqs" else zigzag_shards
        shards = shard_fn(token_ids.shape[0], 1 if self.tp else self.world_size)
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
        seq = self.kv.allocate(seq_id, shard.length + reserve)

        def attend(layer, q, k, v):                                     # q [n, H, D], k, v [n, Hkv, D]
            seq.write(layer, 0, k, v)
            return attention(q, seq.block(layer, shard.length))

        hidden = self.model.forward(local_ids, positions.to(self.device), attend)   # [n, hidden]
        seq.length = shard.length
        self.tokens_per_rank[seq_id] = [s.length for s in shards] * (self.world_size if self.tp else 1)
        self.prompt_tokens_per_rank[seq_id] = list(self.tokens_per_rank[seq_id])
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
    def decode(self, seq_ids: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor | None:
        """One new token per sequence -> logits [B, V] (CPU fp32) on worker 0."""
        owned = [self._next_owner(s) == self.rank for s in seq_ids]
        seqs = [self.kv.seqs[s] for s in seq_ids]
        self.decode_attention.begin_step(seqs, owned)
        tokens = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model.forward(tokens, pos, self.decode_attention)   # [B, hidden]
        self.decode_attention.end_step()
        return self.model.logits(hidden).cpu() if self.rank == 0 else None

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
            per_layer = attention.time_exchanges_alone(shape, self.kv.dtype, self.device)
            self._exchange_alone[num_tokens] = per_layer * self.cfg.num_layers
        return self._exchange_alone[num_tokens]

    def _next_owner(self, seq_id: int) -> int:
        counts = self.tokens_per_rank[seq_id]
        if self.tp:   # every worker stores every token (for its own heads)
            for r in range(len(counts)):
                counts[r] += 1
            return self.rank
        owner = next_kv_owner(counts)
        counts[owner] += 1
        return owner

    @torch.inference_mode()
    def fork(self, source_id: int, seq_id: int, reserve: int) -> None:
        """A new sequence whose cache starts as a copy of the source's prompt K/V (the prompt's tokens
        fill each worker's first slots; what the source decoded since is not copied)."""
        counts = self.prompt_tokens_per_rank[source_id]
        n = counts[self.rank]
        source = self.kv.seqs[source_id]
        seq = self.kv.allocate(seq_id, n + reserve)
        seq.kv[:, :n] = source.kv[:, :n]
        seq.length = n
        self.tokens_per_rank[seq_id] = list(counts)
        self.prompt_tokens_per_rank[seq_id] = list(counts)

    def free(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self.kv.free(s)
            self.tokens_per_rank.pop(s, None)
            self.prompt_tokens_per_rank.pop(s, None)

    def info(self) -> dict:
        total = self.kv_capacity_tokens * (1 if self.tp else self.world_size)   # tp: every worker holds every token
        return {"rank": self.rank, "device": str(self.device), "kernel": self.backend.name,
                "kv_capacity_tokens": self.kv_capacity_tokens, "kv_capacity_total": total}

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.data_group)
        return x

    def kv_tokens_per_worker(self) -> list[int]:
        """Tokens each worker holds over all live sequences (the same bookkeeping on every worker)."""
        totals = [0] * self.world_size
        for counts in self.tokens_per_rank.values():
            for r, n in enumerate(counts):
                totals[r] += n
        return totals

    def _kv_capacity(self) -> int:
        """Tokens of KV cache this worker admits: as configured, else a share of free GPU memory."""
        if self.engine.kv_cache_tokens:
            return self.engine.kv_cache_tokens
        if self.device.type != "cuda":
            return CPU_KV_TOKENS
        free, _ = torch.cuda.mem_get_info(self.device)
        per_token = self.cfg.num_layers * 2 * self.cfg.num_kv_heads * self.cfg.head_dim * self.kv.dtype.itemsize
        return int(free * self.engine.kv_cache_memory_fraction) // per_token

    def _peak_memory_all_workers(self) -> int:
        """The largest peak of allocated GPU memory over the workers (bytes)."""
        peak = torch.tensor([torch.cuda.max_memory_allocated(self.device)], device=self.device)
        if self.world_size > 1:
            peak = all_gather(peak, self.world_size, self.data_group)
        return int(peak.max())

    def _sync(self) -> None:
        synchronize(self.device)

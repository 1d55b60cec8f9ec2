"""A worker's memory at start: whether its weights fit, how many KV pages its pool gets (the same number on
every worker), what the pool leaves for a chunk's activations and its pass-Q, and at the end of a prefill
the workers' peak. The arithmetic is engine/pages/sizing.py's; this module measures the device and makes
the workers agree (one all-reduce)."""
import gc
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from burstserve.engine.core.errors import ModelLoadError
from burstserve.engine.model.config import EngineConfig, ModelConfig
from burstserve.engine.pages.sizing import (activation_bytes_per_token, fp8_gather_bytes, kv_bytes_per_token,
                                            mlp_piece_bytes, pass_q_bytes, pool_tokens_on_cpu, pool_tokens_on_gpu,
                                            prefill_rows_reserved)
from burstserve.engine.parallel.decode_attention import all_gather
from burstserve.engine.runner.extend_graphs import MAX_TOKENS as EXTEND_GRAPH_MAX_TOKENS
from burstserve.kernels.kv_quant import is_fp8
from burstserve.kernels.paged_attention import FP8_GATHER_SEGMENT, fa4_available

log = logging.getLogger(__name__)


@dataclass
class PoolSize:
    pages: int                        # KV pages per worker, the fewest over the workers
    prefill_rows_max: int | None      # the rows one call may run (activations reserved); None: the pool's limit
    pass_q_reserve_bytes: int         # what a sharded chunk's pass-Q may hold (0: nothing reserved)


def size_pool(engine: EngineConfig, cfg: ModelConfig, num_kv_heads: int, dtype: torch.dtype, strategy, layout,
              device: torch.device, rank: int, data_group, max_model_len: int) -> PoolSize:
    """Pages per worker: --kv-cache-tokens, else sized from memory (engine/pages/sizing.py); the smallest over
    the workers, so that every worker's pool is the same size. Refuses workers that differ in flash-attn-4."""
    kv_per_token = kv_bytes_per_token(cfg, num_kv_heads, dtype.itemsize, engine.kv_cache_dtype)
    has_fa4 = int(device.type == "cuda" and fa4_available(device))
    rows_max, pass_q = None, 0
    if engine.kv_cache_tokens:
        tokens = engine.kv_cache_tokens
    elif device.type != "cuda":
        tokens = pool_tokens_on_cpu(kv_per_token)
    else:
        # the blocks freed while the weights were built (fused qkv and gate_up copied from their parts) go
        # back to the device first: held in torch's cache they would count as in use and shrink the pool
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        # less what the layout leaves free (burst-zero: the layers and the embedding gathered whole)
        budget = int(engine.gpu_memory_utilization * total) - (total - free) - layout.reserve_bytes()
        share = strategy.kv_share(max_model_len)
        chunk = engine.max_num_batched_tokens
        rows_max = prefill_rows_reserved(share, chunk, engine.max_num_seqs, EXTEND_GRAPH_MAX_TOKENS,
                                         gathers_context=not has_fa4)
        if chunk is not None and has_fa4 and strategy.kv_workers > 1:   # a sharded chunk passes its Q
            pass_q = pass_q_bytes(min(chunk, max_model_len), cfg.num_heads, cfg.head_dim, dtype.itemsize)
            budget -= pass_q
        if is_fp8(engine.kv_cache_dtype) and chunk is not None:       # a chunk gathers its context
            gathered = min(share, FP8_GATHER_SEGMENT + chunk)
            budget -= fp8_gather_bytes(gathered, num_kv_heads, cfg.head_dim, dtype.itemsize)
        budget -= mlp_piece_bytes(cfg, dtype.itemsize)
        tokens = pool_tokens_on_gpu(budget, kv_per_token, activation_bytes_per_token(cfg, dtype.itemsize), rows_max)
        log.info("worker %d: %.1f of %.1f GiB in use after weights (%.1f GiB of tensors); KV pool of %d tokens "
                 "(%.1f GiB) at gpu_memory_utilization %.2f, activations reserved for %d tokens in one call",
                 rank, (total - free) / 2**30, total / 2**30, torch.cuda.memory_allocated(device) / 2**30,
                 tokens, tokens * kv_per_token / 2**30, engine.gpu_memory_utilization, rows_max)
    if tokens < engine.page_size:
        raise ModelLoadError(f"worker {rank} ({device}) has no memory left for the KV cache "
                             f"(room for {max(tokens, 0)} tokens, a page is {engine.page_size}): raise "
                             f"--gpu-memory-utilization (now {engine.gpu_memory_utilization}), lower "
                             f"--max-model-len, or set --kv-cache-tokens")
    # one MIN over the workers: the pages, and flash-attn-4 on every worker (1) / on none (-1 negated)
    agreed = torch.tensor([tokens // engine.page_size, has_fa4, -has_fa4], dtype=torch.int64, device=device)
    if engine.world_size > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=data_group)
    pages, on_every, on_some = agreed.tolist()
    check_same_kernels(rank, device, bool(has_fa4), bool(on_every), bool(-on_some))
    return PoolSize(pages, rows_max, pass_q)


def check_weights_fit(engine: EngineConfig, rank: int, nbytes: int, device: torch.device) -> None:
    """Refuses, before allocating anything, weights larger than this GPU's share for the model
    (--gpu-memory-utilization of its memory), or, on CPU, than the host's memory over all its CPU
    workers, with the numbers."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget, where = engine.gpu_memory_utilization * total, f"{engine.gpu_memory_utilization:.2f} x"
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget, where = total / engine.world_size, f"1/{engine.world_size} of the host's"
    if nbytes > budget:
        raise ModelLoadError(
            f"worker {rank} ({device}) would hold {nbytes / 2**30:.1f} GiB of weights with "
            f"--sp-strategy {engine.sp_strategy} over {engine.world_size} device(s), more than "
            f"{where} {total / 2**30:.1f} GiB = {budget / 2**30:.1f} GiB: "
            + "use --sp-strategy tp or burst-zero over more devices (they split the weights, a mixture's experts "
            "included), or a smaller model")


def check_same_kernels(rank: int, device: torch.device, has_fa4: bool, fa4_on_every: bool, fa4_on_some: bool) -> None:
    """Refuses workers that differ in flash-attn-4: with it a worker captures CUDA graphs whose small
    extends make other collectives than the eager path of a worker without it, so the workers would wait on
    each other for ever at the first such extend. Every worker raises (one all-reduce told them all)."""
    if fa4_on_some and not fa4_on_every:
        where = "runs here but not on every worker" if has_fa4 else "does not run here but runs on other workers"
        raise ModelLoadError(f"worker {rank} ({device}): flash-attn-4 {where}; install the same "
                             "packages (pip install 'burstserve[flash-attn]') on every host, with GPUs of one kind "
                             "(SM90 or newer)")


def peak_memory_all_workers(device: torch.device, world_size: int, data_group) -> int:
    """The largest peak of allocated GPU memory over the workers (bytes)."""
    peak = torch.tensor([torch.cuda.max_memory_allocated(device)], device=device)
    if world_size > 1:
        peak = all_gather(peak, world_size, data_group)
    return int(peak.max())

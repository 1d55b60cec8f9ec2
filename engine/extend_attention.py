"""Attention for an incremental prefill: n new tokens of a sequence whose first L tokens are already
in the distributed KV cache (the next chunk of a chunked prefill; later, a prompt that extends a
cached prefix).

The new tokens are sharded over the workers like a prompt (zigzag over the n new tokens, at
positions L + ...), and each worker's queries see two kinds of keys:
- the new tokens' own K/V, causally: the K/V ring of BurstAttention over the new shards (pass-KV);
- the L cached tokens, every one of them: they sit in the workers' pages, so the queries travel
  instead (pass-Q, Meta's "Context Parallelism for Scalable Million-Token Inference"): one
  all-gather brings every worker all n queries, each attends them to the cached K/V it holds with
  one paged_attention call (no mask: the cache is all before the new tokens), and one all-to-all
  returns each worker the partials of its own queries.
The partials merge in fp32 by LSE. The new tokens' K/V are written into the worker's pages after the
cached ones. On one worker, and with replicated K/V (tp: every worker holds the whole cache for its
heads and the new tokens whole), the new K/V go into the pages first and one causal paged_attention
call over all of the sequence's pages does the rest (causal aligned to the end: new token i sees the
cached tokens and new tokens 0..i), nothing exchanged or merged. A chunk late in a long prompt is
bound by the host's launches (a 256-token chunk after 60K cached tokens: 37 ms whatever the context,
one H200), so one kernel call and no merge per layer is what counts there.
"""
import torch
import torch.distributed as dist

from engine.cache.page_pool import PagePool
from engine.parallel.burst_attention import BurstAttention
from engine.parallel.sharding import Shard
from kernels.attention import AttentionBackend
from kernels.merge import merge_stacked
from kernels.paged_attention import (PrefixRuns, fa4_available, guarded_table, num_sms, paged_attention,
                                     prefix_run_count, prefix_runs, split_prefix_attention)


class ExtendAttention:
    def __init__(self, pool: PagePool, seq_id: int, cached_local: int, slots: torch.Tensor,
                 new_shards: list[Shard], rank: int, backend: AttentionBackend, scale: float, ring=None,
                 overlap: bool = True, group=None, replicated: bool = False):
        """cached_local: the sequence's tokens already on this worker (its first slots); slots [n_w]:
        where this worker's new tokens' K/V go; new_shards: the n new tokens over the workers."""
        self.pool, self.rank, self.scale, self.backend, self.group = pool, rank, scale, backend, group
        self.slots, self.shards, self.replicated = slots, new_shards, replicated
        self.world_size = 1 if replicated else len(new_shards)
        device = pool.device
        mine = new_shards[0 if replicated else rank].length
        keys = cached_local + mine if self.world_size == 1 else cached_local      # one worker: its new keys too
        pages = pool.pages[seq_id][:-(-keys // pool.block_size)] if keys else []
        self.pages, self.cached_local, self.runs = pages, cached_local, None   # runs: see _prefix_runs
        self.table = guarded_table(torch.tensor([pages or [0]], dtype=torch.int32, device=device))  # [1, pages]
        self.keys = torch.tensor([keys], dtype=torch.int32, device=device)                   # [1]
        self.has_cache = keys > 0
        queries = sum(s.length for s in new_shards) if not replicated else mine
        self.cu = {m: torch.tensor([0, m], dtype=torch.int32, device=device)                 # built once, not per layer
                   for m in {queries, mine}}
        self.ring_attention = (None if self.world_size == 1 else
                               BurstAttention(ring, backend, new_shards, rank, scale, overlap))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [n_w, H, D], k and v [n_w, Hkv, D] (this worker's new tokens) -> out [n_w, H, D]."""
        if self.world_size == 1 and self._prefix_runs(layer, q) is not None:                 # the cache split in runs
            self.pool.write(layer, self.slots, k, v)
            return split_prefix_attention(q, k, v, self.pool.k[layer], self.pool.v[layer], self.runs, self.scale,
                                          self.backend)
        if self.world_size == 1:                                                             # one call, causal
            self.pool.write(layer, self.slots, k, v)
            out, _ = paged_attention(q, self.pool.k[layer], self.pool.v[layer], self.table, self.cu[q.shape[0]],
                                     self.keys, self.scale, causal=True, rows_see_keys=True)
            return out
        new = self.ring_attention.forward(q, torch.stack([k, v], dim=1))
        cached = self._cached_partials_of_mine(layer, q)
        self.pool.write(layer, self.slots, k, v)
        outs = torch.stack([new[0].float()] + [o for o, _ in cached])                         # [P, n_w, H, D]
        lses = torch.stack([new[1].float()] + [l for _, l in cached])                         # [P, n_w, H]
        out, _ = merge_stacked(outs, lses)
        return out.to(q.dtype)

    def _prefix_runs(self, layer: int, q: torch.Tensor) -> PrefixRuns | None:
        """On one worker with flash-attn-4, a chunk too small to fill the GPU against a long cached prefix
        has the prefix's keys cut into runs (kernels.paged_attention.prefix_run_count), decided and built
        at the first layer, the same for all."""
        if layer == 0:
            self.runs = None
            device = self.pool.device
            if self.cached_local and device.type == "cuda" and fa4_available(device):
                hkv = self.pool.k.shape[3]
                count = prefix_run_count(q.shape[0], q.shape[1] // hkv, hkv, self.cached_local, num_sms(device))
                if count > 1:
                    self.runs = prefix_runs(self.pages, self.cached_local, self.pool.block_size, q.shape[0],
                                            count, device)
        return self.runs

    def _cached_partials_of_mine(self, layer: int, q: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """pass-Q: every worker's queries against this worker's cache, and back -> one partial per worker."""
        lengths = [s.length for s in self.shards]
        everyone = _all_gather_rows(q, lengths, self.group)                                    # [n, H, D]
        out, lse = paged_attention(everyone, self.pool.k[layer], self.pool.v[layer], self.table,
                                   self.cu[everyone.shape[0]], self.keys, self.scale, causal=False,
                                   rows_see_keys=self.has_cache)                              # my cached K/V
        out = out.float()
        packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)                                   # [n, H, D + 1]
        mine = lengths[self.rank]
        recv = torch.empty((self.world_size * mine,) + packed.shape[1:], dtype=packed.dtype, device=q.device)
        dist.all_to_all_single(recv, packed, output_split_sizes=[mine] * self.world_size,
                               input_split_sizes=lengths, group=self.group)
        recv = recv.view(self.world_size, mine, *packed.shape[1:])
        return [(recv[w, ..., :-1], recv[w, ..., -1]) for w in range(self.world_size)]


def _all_gather_rows(x: torch.Tensor, lengths: list[int], group=None) -> torch.Tensor:
    """x [lengths[rank], ...] on each worker -> [sum(lengths), ...]: every worker's rows in rank order."""
    longest = max(lengths)
    padded = x.new_zeros((longest,) + x.shape[1:])
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, lengths)])

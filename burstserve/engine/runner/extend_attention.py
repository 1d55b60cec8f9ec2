"""Attention for an incremental prefill: n new tokens of a sequence whose first L tokens are already
in the distributed KV cache (the next chunk of a chunked prefill, or a prompt that extends a cached
prefix). Three ways, chosen by ModelRunner (`way`):

- "local": one worker, or tp's replicated K/V (every worker holds every token, for its own heads):
  the worker holds every key the new tokens see. Their K/V go into the pages first and one causal
  paged_attention call over all of the sequence's pages does the rest (causal aligned to the end: new
  token i sees the cached tokens and new tokens 0..i), nothing exchanged or merged. A chunk late in a
  long prompt is bound by the host's launches (a small chunk takes about as long whatever its context),
  so one kernel call and no merge per layer is what counts there.
- "whole" (several workers, fewer than --extend-ring-min-tokens new tokens): every worker runs all n
  new tokens through the model, as a decode step runs its batch; one worker (the one holding fewest
  of the sequence's tokens) keeps their K/V. Per layer each worker attends the n queries to the keys it
  holds with one paged_attention call (the keeper causally over its cached and the new keys, the
  others without a mask over their cached keys), and one all-gather of the partials, merged in fp32,
  gives every worker the same rows. The new tokens' GEMMs run on every worker, but a layer is one
  kernel call and one collective, where the ring's three collectives and merges a layer made a small
  chunk on two workers several times slower than on one (docs/benchmarks.md, Chunked prefill and
  interference).
- "ring": the new tokens sharded over the workers like a prompt (zigzag over the n new tokens, at
  positions L + ...), and each worker's queries see the new tokens' own K/V causally through
  BurstAttention's K/V ring (pass-KV), and the L cached tokens, all visible, by passing the queries
  (pass-Q, Meta's "Context Parallelism for Scalable Million-Token Inference"): one all-gather brings
  every worker all n queries, each attends them to the cached K/V it holds with one paged_attention
  call, and one all-to-all returns each worker the partials of its own queries, merged in fp32 by
  LSE. The new tokens' K/V are written after the cached ones on the worker that ran them.
  With `pass_kv_cached` (--extend-pass kv) the cached K/V travel instead: each worker's cached K/V of
  the sequence, gathered from its pages, goes around the ring ahead of its new K/V in one block
  (engine/parallel/pass_kv.py), attended in full while the next block is in flight.

With flash-attn-4, a chunk too small to fill the GPU against a long cached prefix has that prefix's
keys cut into runs (kernels.paged_attention.split_prefix_attention), in "local" and "whole".
"""
import torch
import torch.distributed as dist

from burstserve.engine.cache.ledger import pages_for
from burstserve.engine.core.placement import ExtendWay, Shard
from burstserve.engine.model.config import MIN_CHUNK
from burstserve.engine.pages.page_pool import PagePool
from burstserve.engine.parallel.burst_attention import BurstAttention
from burstserve.engine.parallel.decode_attention import all_gather_rows, merge_over_workers
from burstserve.engine.parallel.pass_kv import PassKVAttention
from burstserve.kernels.attention import AttentionBackend
from burstserve.kernels.device import num_sms
from burstserve.kernels.merge import merge_partials
from burstserve.kernels.paged_attention import (FP8_GATHER_SEGMENT, PrefixRuns, fa4_available, guarded_table,
                                                paged_attention, prefix_run_count, prefix_runs, split_prefix_attention)

class ExtendAttention:
    def __init__(self, pool: PagePool, seq_id: int, cached_local: int, slots: torch.Tensor,
                 new_shards: list[Shard], rank: int, backend: AttentionBackend, scale: float, ring=None,
                 overlap: bool = True, group=None, way: ExtendWay = ExtendWay.RING, fp8: bool = False,
                 pass_kv_cached: list[int] | None = None, windows: tuple[int, ...] = ()):
        """cached_local: the sequence's tokens already on this worker (its first slots); slots [n_w]:
        where this worker's new tokens' K/V go (empty if it keeps none); new_shards: the n new tokens
        over the workers (way "whole": all on one; "local" under tp: the strategy's one shard);
        pass_kv_cached (way "ring", bf16 pages): every worker's cached tokens of the sequence, by rank, to
        pass the cached K/V around the ring rather than the queries to them (None: pass-Q); windows: per layer
        its sliding window (ModelConfig.layer_windows; a model with windows runs on one worker)."""
        self.windows = windows
        self.pool, self.rank, self.scale, self.backend, self.group = pool, rank, scale, backend, group
        # FP8 attention: the new tokens' own K/V through it; over FP8 pages the cached keys too, gathered a segment at
        # a time as every chunk over FP8 pages gathers them (kernels.paged_attention); over bf16 pages the cached
        # keys through the paged bf16 kernel in place (gathering them would need memory the pool's sizing keeps
        # only for FP8 pages)
        self.fresh_in_fp8 = backend.fp8
        self.gathered_attn = backend if backend.fp8 and pool.fp8 else None
        # ... and where the cached keys fit one gather segment, they and the new keys in one FP8 call
        self.one_fp8_call = self.gathered_attn is not None and 0 < cached_local <= FP8_GATHER_SEGMENT
        self.slots, self.shards, self.way = slots, new_shards, way
        self.world_size = len(new_shards)
        device = pool.device
        mine = new_shards[0 if way == ExtendWay.LOCAL else rank].length
        self.keeps_new = way != ExtendWay.RING and mine > 0           # its paged call covers the new keys, causally
        keys = cached_local + (mine if self.keeps_new else 0)
        pages = pool.pages[seq_id][:pages_for(keys, pool.block_size)] if keys else []
        self.pages, self.cached_local, self.runs = pages, cached_local, None   # runs: see _prefix_runs
        self.cached_blocks = (torch.tensor(pages[:pages_for(cached_local, pool.block_size)], dtype=torch.long,
                                           device=device) if self.one_fp8_call else None)     # [pages of the cache]
        self.table = guarded_table(torch.tensor([pages or [0]], dtype=torch.int32, device=device))  # [1, pages]
        self.keys = torch.tensor([keys], dtype=torch.int32, device=device)                   # [1]
        self.cached_keys = torch.tensor([cached_local], dtype=torch.int32, device=device)    # [1]
        self.key_count = keys
        self.has_keys = keys > 0
        queries = sum(s.length for s in new_shards) if way != ExtendWay.LOCAL else mine
        self.cu = {m: torch.tensor([0, m], dtype=torch.int32, device=device)                 # built once, not per layer
                   for m in {queries, mine}}
        self.ring_attention = (BurstAttention(ring, backend, new_shards, rank, scale, overlap, fp8=fp8)
                               if way == ExtendWay.RING and pass_kv_cached is None else None)
        self.pass_kv = None
        if way == ExtendWay.RING and pass_kv_cached is not None:
            assert not fp8 and pass_kv_cached[rank] == cached_local, (pass_kv_cached, rank, cached_local)
            self.pass_kv = PassKVAttention(ring, backend, new_shards, pass_kv_cached, rank, scale, overlap)
            self.page_ids = torch.tensor(pages or [0], dtype=torch.long, device=device)       # [pages]

    @property
    def reported_way(self) -> ExtendWay:
        """The way in a prefill's figures: RING_KV for a ring that passes the cached K/V."""
        return ExtendWay.RING_KV if self.pass_kv is not None else self.way

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [m, H, D], k and v [m, Hkv, D] -> out [m, H, D]: this worker's new tokens ("ring"), or all n
        of them ("local", "whole")."""
        if self.way == ExtendWay.RING:
            return self._ring(layer, q, k, v)
        if self.keeps_new:
            self.pool.write(layer, self.slots, k, v)
        out, lse = self._local_partial(layer, q, k, v)
        if self.way == ExtendWay.LOCAL:
            return out
        return merge_over_workers(out, lse, self.world_size, self.group)

    def _local_partial(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The queries q [m, H, D] against the sequence's keys on this worker (the new ones causally, when
        it keeps them) -> (out [m, H, D] in q's dtype, lse [m, H] fp32)."""
        if self.windows and self.windows[layer]:            # a sliding-window layer: the keys its window reaches
            return paged_attention(q, *self.pool.layer(layer), self.table, self.cu[q.shape[0]], self.keys, self.scale,
                                   host_sizes=([0, q.shape[0]], [self.key_count]), window=self.windows[layer])
        if self.fresh_in_fp8 and self.keeps_new:
            return self._fresh_in_fp8(layer, q, k, v)
        runs = self._prefix_runs(layer, q)
        if runs is not None:                                                                 # the cache in runs
            new_k, new_v = (k, v) if self.keeps_new else (None, None)
            return split_prefix_attention(q, new_k, new_v, *self.pool.layer(layer), runs, self.scale,
                                          self.backend)
        if not self.has_keys:                                                               # none of its keys here
            return (torch.zeros_like(q), torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device))
        return paged_attention(q, *self.pool.layer(layer), self.table, self.cu[q.shape[0]], self.keys,
                               self.scale, causal=self.keeps_new, rows_see_keys=True,
                               host_sizes=([0, q.shape[0]], [self.key_count]), gathered_attn=self.gathered_attn)

    def _fresh_in_fp8(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """FP8 attention: the new tokens' own K/V causally through the FP8 kernel, the cached keys over the pages
        (FP8 pages: gathered, through the FP8 kernel too, in the same call where they fit one gather segment;
        bf16 pages: the paged bf16 kernel), merged by LSE -> (out [m, H, D], lse [m, H])."""
        if not self.cached_local:
            return self.backend(q, k, v, True, self.scale)                                 # a square
        if self.one_fp8_call:
            return self._cached_and_fresh_in_one_call(layer, q, k, v)
        fresh = self.backend(q, k, v, True, self.scale)                                    # a square
        cached = paged_attention(q, *self.pool.layer(layer), self.table, self.cu[q.shape[0]], self.cached_keys,
                                 self.scale, causal=False, rows_see_keys=True,
                                 host_sizes=([0, q.shape[0]], [self.cached_local]), gathered_attn=self.gathered_attn)
        return merge_partials(torch.stack([cached[0], fresh[0]]), torch.stack([cached[1], fresh[1]]), q.dtype)

    def _cached_and_fresh_in_one_call(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Over FP8 pages, cached keys of at most one gather segment: gathered, the new k, v [m, Hkv, D] (unrounded)
        after them, one causal call (end-aligned: new token i sees the cache and new tokens 0..i) through the FP8
        kernel -> (out [m, H, D], lse [m, H]). q cast once, one kernel at a long call's rate, nothing merged; the
        cached and new keys share their calls' scales a KV head."""
        k_pages, v_pages = self.pool.layer(layer)
        gather = lambda pages: pages.gather_range(self.cached_blocks, 0, self.cached_local, q.dtype)  # noqa: E731
        keys = torch.cat([gather(k_pages), k])                                            # [c + m, Hkv, D]
        values = torch.cat([gather(v_pages), v])                                          # (one gathered at a time)
        return self.backend(q, keys, values, True, self.scale)

    def _ring(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        store = lambda: self.pool.write(layer, self.slots, k, v)       # noqa: E731  (behind the first exchange)
        if self.pass_kv is not None:
            return self.pass_kv.forward(q, self._pass_kv_block(layer, k, v), store)[0]
        new = self.ring_attention.forward(q, torch.stack([k, v], dim=1), store)
        cached = self._cached_partials_of_mine(layer, q)
        outs = torch.stack([new[0].float()] + [o for o, _ in cached])                         # [P, n_w, H, D]
        lses = torch.stack([new[1].float()] + [l for _, l in cached])                         # [P, n_w, H]
        return merge_partials(outs, lses, q.dtype)[0]

    def _pass_kv_block(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This worker's pass-KV block: its cached K/V of the sequence from its pages, then the new k, v [n_w,
        Hkv, D] -> [cached_local + n_w, 2, Hkv, D], filled in place (one of K or V's pages gathered at a time)."""
        c = self.cached_local
        block = torch.empty((c + k.shape[0], 2) + k.shape[1:], dtype=k.dtype, device=k.device)
        for i, cache in enumerate(self.pool.layer(layer)):                     # [pages, page, Hkv, D]
            block[:c, i] = cache.index_select(0, self.page_ids).flatten(0, 1)[:c]
        block[c:, 0], block[c:, 1] = k, v
        return block

    def _prefix_runs(self, layer: int, q: torch.Tensor) -> PrefixRuns | None:
        """With flash-attn-4, a chunk too small to fill the GPU against a long cached prefix on this worker
        has the prefix's keys cut into runs (kernels.paged_attention.prefix_run_count), decided and built
        at the first layer, the same for all."""
        if layer == 0:
            self.runs = None
            device = self.pool.device
            if self.cached_local and device.type == "cuda" and fa4_available(device) and not self.pool.fp8:
                hkv = self.pool.k.shape[3]
                count = prefix_run_count(q.shape[0], q.shape[1] // hkv, hkv, self.cached_local, num_sms(device))
                if count > 1:
                    self.runs = prefix_runs(self.pages, self.cached_local, self.pool.block_size, q.shape[0],
                                            count, device)
        return self.runs

    def _cached_partials_of_mine(self, layer: int, q: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """pass-Q: every worker's queries against this worker's cache, and back -> one partial per worker."""
        lengths = [s.length for s in self.shards]
        everyone = all_gather_rows(q, lengths, self.group)                                    # [n, H, D]
        out, lse = paged_attention(everyone, *self.pool.layer(layer), self.table,
                                   self.cu[everyone.shape[0]], self.keys, self.scale, causal=False,
                                   rows_see_keys=self.has_keys, host_sizes=([0, everyone.shape[0]], [self.key_count]),
                                   gathered_attn=self.gathered_attn)                          # my cached K/V
        out = out.float()
        packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)                                   # [n, H, D + 1]
        mine = lengths[self.rank]
        recv = torch.empty((self.world_size * mine,) + packed.shape[1:], dtype=packed.dtype, device=q.device)
        dist.all_to_all_single(recv, packed, output_split_sizes=[mine] * self.world_size,
                               input_split_sizes=lengths, group=self.group)
        recv = recv.view(self.world_size, mine, *packed.shape[1:])
        return [(recv[w, ..., :-1], recv[w, ..., -1]) for w in range(self.world_size)]


@torch.inference_mode()
def warm_extend_kernels(pool: PagePool, backend: AttentionBackend, scale: float, num_heads: int, num_kv_heads: int,
                        head_dim: int, dtype: torch.dtype) -> None:
    """Builds the flash-attn-4 kernels an incremental prefill uses in its "local" and "whole" ways (the causal
    paged call over cached + new keys, the unmasked one over cached keys, and a small late chunk's prefix runs
    with their causal call over the chunk), so that none is built under load: a kernel built on first use
    while streams decode stalls every one of them for the whole build (a second or more). Reads only the
    scratch page; the results are dropped. Each worker alone, at start."""
    m, hkv, device = MIN_CHUNK, num_kv_heads, pool.device
    q = torch.randn(m, num_heads, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(m, hkv, head_dim, device=device, dtype=dtype) for _ in range(2))
    pages = [0] * pages_for(2 * m, pool.block_size)                      # the scratch page, 2 m keys' worth
    keys = len(pages) * pool.block_size
    table = guarded_table(torch.tensor([pages], dtype=torch.int32, device=device))
    cu = torch.tensor([0, m], dtype=torch.int32, device=device)
    lens = torch.tensor([keys], dtype=torch.int32, device=device)
    for causal in (True, False):
        paged_attention(q, *pool.layer(0), table, cu, lens, scale, causal=causal, rows_see_keys=True)
    runs = prefix_runs(pages, keys, pool.block_size, m, 2, device)
    split_prefix_attention(q, k, v, *pool.layer(0), runs, scale, backend)

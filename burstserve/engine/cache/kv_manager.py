"""The KV cache's one owner, on worker 0's scheduler's side: the ledger of which worker holds which tokens of
every sequence (engine/cache/ledger.py) and on which of its pages, the prefix cache's entries, and what a call
would take. Workers keep no ledger and pick no page: `place` says where a call's new tokens go (a prompt by
the strategy's shards, an extend's way and shards, each decode row's storing workers) and on which pages of
each worker, and every cache change carries its tokens and pages by worker, so a worker stores what it is
told where it is told.

Queries change nothing: how many pages a prefill, chunk, copy or decode step takes on each worker
(engine/cache/page_planner.py), and whether they fit, after evicting which prefix-cache entries
(`room_for`: a list of Evictions, or None). Actions change the cache and tell every worker: evict,
retire a sequence into an entry, take one back, copy a prefix or a prompt, free; each changes the ledger and
sends its call.

Eviction: least recently used entry first, from its tail (an entry gives back only the pages needed,
keeping its longest prefix of whole hashed blocks); entries still being copied to the host tier after the
others (freeing their pages would wait for the copy); preempted sequences' entries after all others (they
will be resumed), and the entry holding the longest prefix of the prompt being admitted last of all (it
is about to be copied).

The host tier (--kv-offload-gb, engine/pages/host_pool.py), when there is one, is a second prefix cache
with its own ledger, kept here as the pool's. A sequence retiring into an entry is
copied there at once (write-through: the copy runs beside compute, so evicting the GPU entry later costs
nothing), unless the tier already holds all but a little of it (less than an eighth, OFFLOAD_GAIN); host
entries are evicted whole, least recently used first, and one that is a prefix of a newer entry goes when
that one comes. A prompt whose longest prefix in the host tier is longer than in the pool by at least an
eighth of it (RESTORE_GAIN) restores it from there (Restore), else copies it in the pool (Adopt).
"""
from dataclasses import dataclass, replace

from burstserve.engine.cache.host_copies import HostCopies
from burstserve.engine.cache.ledger import KVLedger, pages_for
from burstserve.engine.cache.page_planner import PagePlanner
from burstserve.engine.cache.prefix_cache import BLOCK, Chain, PrefixCache
from burstserve.engine.core.calls import (Adopt, Decode, Extend, ExtendAndDecode, ExtendPlacement, Fork, Free, HostFree,
                                     Offload, Prefill, Reinstate, Restore, Retire, Truncate)

OFFLOAD_GAIN = 8     # a retiring entry is copied to the host tier when at least 1/8 of it is not there yet
RESTORE_GAIN = 8     # a host hit is restored when it is longer than the pool's by at least 1/8 of it


@dataclass(frozen=True)
class Eviction:
    seq_id: int      # a prefix-cache entry
    keep: int        # the tokens it keeps (a multiple of the prefix cache's block); 0: all freed


@dataclass(frozen=True)
class Hit:
    """The longest cached prefix of a prompt: `length` tokens of an entry in the pool or in the host tier."""
    entry: int
    length: int
    on_host: bool = False


def worth_restoring(host: Hit, in_pool: int) -> bool:
    """A host-tier hit is restored over `in_pool` tokens in the pool: longer by at least a block and an eighth
    of it."""
    return host.length - in_pool >= max(BLOCK, host.length // RESTORE_GAIN)


class KVManager:
    @classmethod
    def of_workers(cls, engine, facts, call, prefix_caching: bool) -> "KVManager":
        """The KV manager of workers that reported `facts` (engine/core/messages.py WorkerFacts: their strategy's
        placement, their pool's and host tier's sizes, the same on every worker) under the engine's options
        (EngineConfig)."""
        placement = facts.placement
        ledger = KVLedger(engine.world_size, engine.page_size, facts.kv_pages_per_worker, placement.replicated_kv)
        pages = PagePlanner(placement, ledger, facts.max_pages_per_seq, engine.extend_ring_min_tokens)
        host_ledger = (KVLedger(engine.world_size, engine.page_size, facts.kv_host_pages, placement.replicated_kv,
                                first_page=0) if facts.kv_host_pages else None)
        return cls(ledger, pages, call, prefix_caching, host_ledger)

    def __init__(self, ledger: KVLedger, pages: PagePlanner, call, prefix_caching: bool,
                 host_ledger: KVLedger | None = None):
        """ledger, pages: its own (no worker's); call(message): sends one engine/core/calls.py message to every
        worker; host_ledger: the host tier's (None: no tier)."""
        self.ledger, self.pages, self.call = ledger, pages, call
        self.prefix_cache = PrefixCache() if prefix_caching else None
        self.host = host_ledger if prefix_caching else None
        self.host_cache = PrefixCache() if self.host is not None else None
        self.host_capacity_per_worker = self.host.num_pages * self.host.block_size if self.host else 0
        self.host_hits = 0                    # prompt tokens restored from the host tier
        self.host_evicted_tokens = 0
        self.stored_bytes = self.restored_bytes = 0    # worker 0's copies to and from the host tier
        self.copies = HostCopies()             # the tier's copies still running (engine/cache/host_copies.py)
        self.watermark = max(1, ledger.num_pages // 100)   # pages kept free for running sequences to grow
        self.capacity_per_worker = ledger.num_pages * ledger.block_size
        self._chain_of: list[int] | None = None          # the prompt whose Chain is _chain_keys (_chain)
        self._chain_keys: Chain | None = None

    # queries

    def room_for(self, need: list[int], keep_entry: int | None = None, prompt: list[int] | None = None,
                 last: list[int] = (), first: list[int] = ()) -> "list[Eviction] | None":
        """Do `need` pages fit on every worker? -> the evictions that make them fit ([] when they fit now),
        None when even evicting every entry (but `keep_entry`) would not do. `last`: entries evicted after
        all others, in this order; `first`: before all others; `prompt`: what the pages are for (its longest
        cached prefix goes last)."""
        free = self.ledger.free_pages()
        if all(n <= f for n, f in zip(need, free)):
            return []
        entries = self._eviction_order(keep_entry, prompt, last, first)
        evictable = [sum(self.ledger.pages_of(e, r) for e in entries) for r in range(len(free))]
        if not all(n <= f + e for n, f, e in zip(need, free, evictable)):
            return None
        evictions = []
        for entry in entries:
            short = [max(0, n - f) for n, f in zip(need, free)]
            if not any(short):
                break
            eviction = self._eviction_of(entry, short)
            freed = self.ledger.pages_freed_by_truncating(entry, eviction.keep)
            free = [f + g for f, g in zip(free, freed)]
            evictions.append(eviction)
        return evictions

    def _eviction_order(self, keep_entry: int | None, prompt: list[int] | None, last: list[int],
                        first: list[int]) -> list[int]:
        """The entries to evict from, first to last."""
        if self.prefix_cache is None:
            return []
        early = [e for e in first if e in self.prefix_cache.entries and e != keep_entry]
        entries = [e for e in self.prefix_cache.entries if e != keep_entry and e not in early]
        copying = [e for e in entries if self.copies.storing(e)]       # freeing them would wait for the copy
        entries = [e for e in entries if e not in copying] + copying
        hit = self.prefix_cache.longest(prompt, keys=self._chain(prompt)) if prompt else None
        if hit is not None and hit[0] in entries:
            entries.remove(hit[0])
            entries.append(hit[0])
        late = [e for e in last if e in entries]
        return early + [e for e in entries if e not in late] + late

    def _eviction_of(self, seq_id: int, short: list[int]) -> Eviction:
        """What frees at least `short` pages per worker from an entry: its tail when keeping a prefix of whole
        hashed blocks leaves enough (the longest such prefix kept), else the whole entry."""
        def enough(blocks: int) -> bool:
            freed = self.ledger.pages_freed_by_truncating(seq_id, blocks * BLOCK)
            return all(f >= s for f, s in zip(freed, short))

        blocks = len(self.prefix_cache.entries[seq_id]) // BLOCK
        if blocks < 1 or not enough(1):
            return Eviction(seq_id, 0)
        return Eviction(seq_id, most_blocks(enough, 1, blocks) * BLOCK)     # the most blocks kept that free enough

    def kept(self, seq_id: int) -> int:
        """How many tokens the sequence's prefix-cache entry holds (0: no entry)."""
        if self.prefix_cache is None or seq_id not in self.prefix_cache.entries:
            return 0
        return len(self.prefix_cache.entries[seq_id])

    def prefixes(self, ids: list[int], skip: int | None = None) -> list[Hit]:
        """The longest cached prefixes of ids to copy, best first: the pool's, or the host tier's where that
        holds enough more (RESTORE_GAIN); after the pool's, the host tier's (restored when the pool's copy does
        not fit beside its source). skip: an entry of the pool not to copy (about to be dropped)."""
        if self.prefix_cache is None:
            return []
        keys = self._chain(ids)                               # hashed once for both caches
        gpu = self.prefix_cache.longest(ids, keys=keys, skip=skip)
        in_pool = Hit(*gpu) if gpu is not None else None
        host = self.host_cache.longest(ids, keys=keys) if self.host_cache is not None else None
        if host is None:
            return [in_pool] if in_pool is not None else []
        host = Hit(*host, on_host=True)
        if worth_restoring(host, in_pool.length if in_pool else 0):
            return [host]
        return [h for h in (in_pool, host) if h is not None]     # the host tier's when the copy does not fit

    def _chain(self, ids: list[int]) -> Chain:
        """The hash chain of a prompt's blocks (to its last token), hashed once for the prompt asked about
        last: the head of the queue is planned every turn until it runs (a 128K-token prompt's chain took
        about 4 ms of the host's time)."""
        if self._chain_of is not ids:
            self._chain_of, self._chain_keys = ids, Chain(ids, len(ids) - 1)
        return self._chain_keys

    def host_hit(self, ids: list[int], in_pool: int) -> Hit | None:
        """The host tier's longest prefix of ids, if it is worth restoring over the `in_pool` tokens the pool
        holds."""
        host = self.host_cache.longest(ids, keys=self._chain(ids)) if self.host_cache is not None else None
        if host is None or not worth_restoring(Hit(*host), in_pool):
            return None
        return Hit(*host, on_host=True)

    def hit_pages(self, hit: Hit, rest: int, chunk: int | None) -> list[int]:
        """Pages per worker to copy the hit (from the pool or the host tier) and extend it by `rest` tokens."""
        return self.pages.adopt_pages(hit.entry, hit.length, rest, chunk, tier=self.host if hit.on_host else None)

    def free_pages(self) -> list[int]:
        return self.ledger.free_pages()

    def step_pages(self, seq_ids: list[int]) -> list[int]:
        """Pages per worker a decode step of these sequences takes."""
        return self.ledger.step_new_pages(seq_ids)

    def host_tokens_per_worker(self) -> list[int]:
        """Tokens the host tier's entries hold on each worker."""
        return self.host.tokens_per_worker() if self.host is not None else []

    def tokens_per_worker(self, cached: bool = False) -> list[int]:
        """Tokens per worker in use (prefix-cache entries count as free, as vLLM counts them), or with
        `cached` those the entries hold."""
        entries = set(self.prefix_cache.entries) if self.prefix_cache else set()
        return self.ledger.tokens_per_worker(only=entries) if cached else self.ledger.tokens_per_worker(skip=entries)

    # actions

    def place(self, call):
        """Where a call's new tokens go, recorded in the ledger -> the call, placed (work calls; any other as it is):
        a prefill's prompt by the strategy's shards; an extend's way and shards (ExtendPlacement); each decode
        row's storing workers; a chunk with a decode step: the step's pages set aside first, the chunk placed
        beside them, then the step's tokens (as a worker stores them)."""
        if isinstance(call, Prefill):
            shards = self.pages.prefill_shards(call.token_ids.shape[0])
            pages = self.ledger.add(call.seq_id, self.pages.tokens_per_rank(shards), self.pages.ranges(shards, 0))
            return replace(call, pages=pages)
        if isinstance(call, Extend):
            return self._place_extend(call)
        if isinstance(call, Decode):
            owners, new_pages = zip(*[self.ledger.advance(s) for s in call.seq_ids]) if call.seq_ids else ((), ())
            return replace(call, owners=list(owners), new_pages=list(new_pages))
        if isinstance(call, ExtendAndDecode):
            extend = self._place_extend(call.extend, self.ledger.step_new_pages(call.decode.seq_ids))
            return ExtendAndDecode(extend, self.place(call.decode))
        return call

    def _place_extend(self, call: Extend, reserved: list[int] | None = None) -> Extend:
        """reserved: pages per worker a decode step in the same call takes (PagePlanner.extend_way)."""
        n, held = call.token_ids.shape[0], list(self.ledger.seqs[call.seq_id].tokens)
        way = self.pages.extend_way(n, held, reserved)
        shards = self.pages.extend_shards(held, n, way)
        tokens, ranges = self.pages.tokens_per_rank(shards), self.pages.ranges(shards, call.start)
        pages = self.ledger.extend(call.seq_id, tokens, ranges)
        return replace(call, placed=ExtendPlacement(way, shards, held, pages))

    def count_query(self, ids: list[int]) -> None:
        """A prompt looked up in the prefix cache (its tokens counted as queried; `adopt` counts a hit)."""
        if self.prefix_cache is not None:
            self.prefix_cache.queries += len(ids)

    def evict(self, evictions: "list[Eviction]") -> None:
        for e in evictions:
            if e.keep:
                self.prefix_cache.truncate(e.seq_id, e.keep)
                self.call(Truncate(e.seq_id, e.keep, self.ledger.truncate(e.seq_id, e.keep)))
            else:
                self.drop(e.seq_id)

    def drop(self, seq_id: int) -> None:
        """A prefix-cache entry freed."""
        self.prefix_cache.remove(seq_id)
        self.free([seq_id])

    def retire(self, seq_id: int, computed: list[int]) -> None:
        """The sequence's pages stay as a prefix-cache entry of the tokens whose K/V they hold (and are copied
        to the host tier, if it lacks enough of them)."""
        self.call(Retire([seq_id]))
        keys = Chain(computed)                               # hashed once for both caches
        self.prefix_cache.insert(seq_id, computed, keys)
        if self.host_cache is not None:
            self._offload(seq_id, computed, keys)

    def _offload(self, seq_id: int, tokens: list[int], keys: Chain) -> None:
        """Copies the entry to the host tier unless it holds all but less than 1/OFFLOAD_GAIN of it already;
        the host entries it supersedes (its prefixes, its own older copy) go first, then the least recently
        used ones until it fits (a prefix of whole blocks, if the whole tier is too small)."""
        have = self.host_cache.longest(tokens, limit=len(tokens), keys=keys)     # a match may cover every token
        if len(tokens) - (have[1] if have else 0) < max(BLOCK, len(tokens) // OFFLOAD_GAIN):
            return
        stale = [e for e in self.host_cache.entries
                 if e == seq_id or (have and e == have[0] and len(self.host_cache.entries[e]) <= have[1])]
        self.host_drop(stale, evicted=False)
        position = self._host_room(seq_id, len(tokens))
        if position < BLOCK:
            return
        counts = self.host.add_prefix_of(seq_id, seq_id, position, tier=self.ledger)
        self.stored_bytes += self.call(Offload(seq_id, position, counts, self._pages(self.host, seq_id)))
        self.copies.issued(storing=seq_id)
        self.host_cache.insert(seq_id, tokens[:position], keys if position == len(tokens) else None)

    def _host_room(self, seq_id: int, length: int) -> int:
        """Host pages for the sequence's first `length` tokens, made by evicting host entries least recently
        used first -> the tokens that fit: `length`, or the longest prefix of whole blocks the empty tier holds."""
        def fits(position: int, free: list[int]) -> bool:
            need = [pages_for(n, self.host.block_size) for n in self.ledger.held_before(seq_id, position)]
            return all(n <= f for n, f in zip(need, free))

        whole = [self.host.num_pages] * self.host.world_size
        if not fits(length, whole):
            length = most_blocks(lambda blocks: fits(blocks * BLOCK, whole), 0, length // BLOCK) * BLOCK
        for entry in list(self.host_cache.entries):
            if fits(length, self.host.free_pages()):
                break
            self.host_drop([entry])
        return length

    def host_drop(self, host_ids: list[int], evicted: bool = True) -> None:
        """Host entries freed (evicted: counted as such)."""
        if not host_ids:
            return
        for h in host_ids:
            if evicted:
                self.host_evicted_tokens += len(self.host_cache.entries[h])
            self.host_cache.remove(h)
            self.host.remove(h)
        self.call(HostFree(list(host_ids)))

    def reinstate(self, seq_id: int) -> None:
        """A preempted sequence takes its entry's pages back, to decode or extend on them."""
        self.prefix_cache.remove(seq_id)
        self.call(Reinstate([seq_id]))

    def adopt(self, hit: Hit, seq_id: int) -> None:
        """A new sequence starts as a copy of the hit's `length` tokens: in the pool, or restored from the host
        tier (counted as a hit of the prefix cache; the entry becomes the most recently used)."""
        self.prefix_cache.hits += hit.length
        if hit.on_host:
            self.host_cache.touch(hit.entry)
            self.host_hits += hit.length
            counts = self.ledger.add_prefix_of(hit.entry, seq_id, hit.length, tier=self.host)
            self.restored_bytes += self.call(Restore(hit.entry, seq_id, hit.length, counts,
                                                     self._pages(self.ledger, seq_id)))
            self.copies.issued(loading=seq_id)
        else:
            self.prefix_cache.touch(hit.entry)
            counts = self.ledger.add_prefix_of(hit.entry, seq_id, hit.length)
            self.call(Adopt(hit.entry, seq_id, hit.length, counts, self._pages(self.ledger, seq_id)))

    def fork(self, source_id: int, seq_id: int) -> None:
        """A new sequence starts as a copy of the source's prompt."""
        counts = self.ledger.prompt_tokens(source_id)
        pages = self.ledger.add(seq_id, counts, self.ledger.prompt_ranges(source_id))
        self.call(Fork(source_id, seq_id, counts, pages))

    def free(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self.ledger.remove(s)
        self.call(Free(seq_ids))

    @staticmethod
    def _pages(ledger: KVLedger, seq_id: int) -> list[list[int]]:
        """The sequence's pages in that ledger, by rank (what a copy into them ships)."""
        return [ledger.page_ids(seq_id, r) for r in range(ledger.world_size)]


def most_blocks(holds, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] for which holds(n), holds being true up to some n and false beyond (holds(lo)
    is taken as true): a binary search."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid - 1)
    return lo

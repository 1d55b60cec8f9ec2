"""Worker 0's scheduler's view of the KV cache: the pages every worker holds, the prefix cache's entries,
and what a call would take.

Queries change nothing: how many pages a prefill, chunk, copy or decode step takes on each worker
(engine/cache/page_planner.py), and whether they fit, after evicting which prefix-cache entries
(`room_for`: a list of Evictions, or None). Actions change the cache and tell every worker: evict,
retire a sequence into an entry, take one back, copy a prefix or a prompt, free. The ledger it reads is
worker 0's, which every worker keeps identical (engine/cache/ledger.py).

Eviction: least recently used entry first, from its tail (an entry gives back only the pages needed,
keeping its longest prefix of whole hashed blocks); preempted sequences' entries after all others (they
will be resumed), and the entry holding the longest prefix of the prompt being admitted last of all (it
is about to be copied).
"""
from dataclasses import dataclass

from engine.cache.ledger import KVLedger
from engine.cache.page_planner import PagePlanner
from engine.cache.prefix_cache import BLOCK, PrefixCache
from engine.calls import Adopt, Fork, Free, Reinstate, Retire, Truncate


@dataclass(frozen=True)
class Eviction:
    seq_id: int      # a prefix-cache entry
    keep: int        # the tokens it keeps (a multiple of the prefix cache's block); 0: all freed


class KVManager:
    def __init__(self, ledger: KVLedger, pages: PagePlanner, call, prefix_caching: bool):
        """call(message): sends one engine/calls.py message to every worker."""
        self.ledger, self.pages, self.call = ledger, pages, call
        self.prefix_cache = PrefixCache() if prefix_caching else None
        self.watermark = max(1, ledger.num_pages // 100)   # pages kept free for running sequences to grow
        self.capacity_per_worker = ledger.num_pages * ledger.block_size

    # queries

    def room_for(self, need: list[int], keep_entry: int | None = None, prompt: list[int] | None = None,
                 last: list[int] = ()) -> "list[Eviction] | None":
        """Do `need` pages fit on every worker? -> the evictions that make them fit ([] when they fit now),
        None when even evicting every entry (but `keep_entry`) would not do. `last`: entries evicted after
        all others, in this order; `prompt`: what the pages are for (its longest cached prefix goes last)."""
        free = self.ledger.free_pages()
        if all(n <= f for n, f in zip(need, free)):
            return []
        entries = self._eviction_order(keep_entry, prompt, last)
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

    def _eviction_order(self, keep_entry: int | None, prompt: list[int] | None, last: list[int]) -> list[int]:
        """The entries to evict from, first to last."""
        if self.prefix_cache is None:
            return []
        entries = [e for e in self.prefix_cache.entries if e != keep_entry]
        hit = self.prefix_cache.longest(prompt) if prompt else None
        if hit is not None and hit[0] in entries:
            entries.remove(hit[0])
            entries.append(hit[0])
        late = [e for e in last if e in entries]
        return [e for e in entries if e not in late] + late

    def _eviction_of(self, seq_id: int, short: list[int]) -> Eviction:
        """What frees at least `short` pages per worker from an entry: its tail when keeping a prefix of whole
        hashed blocks leaves enough (the longest such prefix kept), else the whole entry."""
        def enough(blocks: int) -> bool:
            freed = self.ledger.pages_freed_by_truncating(seq_id, blocks * BLOCK)
            return all(f >= s for f, s in zip(freed, short))

        lo, hi = 1, len(self.prefix_cache.entries[seq_id]) // BLOCK   # the most blocks kept that free enough
        if hi < 1 or not enough(lo):
            return Eviction(seq_id, 0)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if enough(mid) else (lo, mid - 1)
        return Eviction(seq_id, lo * BLOCK)

    def kept(self, seq_id: int) -> int:
        """How many tokens the sequence's prefix-cache entry holds (0: no entry)."""
        if self.prefix_cache is None or seq_id not in self.prefix_cache.entries:
            return 0
        return len(self.prefix_cache.entries[seq_id])

    def cached_prefix(self, ids: list[int]) -> "tuple[int, int] | None":
        """(entry, length) of the longest cached prefix of ids, counted as a query of the prefix cache."""
        return self.prefix_cache.lookup(ids) if self.prefix_cache is not None else None

    def free_pages(self) -> list[int]:
        return self.ledger.free_pages()

    def step_pages(self, seq_ids: list[int]) -> list[int]:
        """Pages per worker a decode step of these sequences takes."""
        return self.ledger.step_new_pages(seq_ids)

    def tokens_per_worker(self, cached: bool = False) -> list[int]:
        """Tokens per worker in use (prefix-cache entries count as free, as vLLM counts them), or with
        `cached` those the entries hold."""
        entries = set(self.prefix_cache.entries) if self.prefix_cache else set()
        return self.ledger.tokens_per_worker(only=entries) if cached else self.ledger.tokens_per_worker(skip=entries)

    # actions

    def evict(self, evictions: "list[Eviction]") -> None:
        for e in evictions:
            if e.keep:
                self.prefix_cache.truncate(e.seq_id, e.keep)
                self.call(Truncate(e.seq_id, e.keep))
            else:
                self.drop(e.seq_id)

    def drop(self, seq_id: int) -> None:
        """A prefix-cache entry freed."""
        self.prefix_cache.remove(seq_id)
        self.call(Free([seq_id]))

    def retire(self, seq_id: int, computed: list[int]) -> None:
        """The sequence's pages stay as a prefix-cache entry of the tokens whose K/V they hold."""
        self.call(Retire([seq_id]))
        self.prefix_cache.insert(seq_id, computed)

    def reinstate(self, seq_id: int) -> None:
        """A preempted sequence takes its entry's pages back, to decode or extend on them."""
        self.prefix_cache.remove(seq_id)
        self.call(Reinstate([seq_id]))

    def adopt(self, source_id: int, seq_id: int, length: int) -> None:
        """A new sequence starts as a copy of the source's first `length` tokens."""
        self.call(Adopt(source_id, seq_id, length))

    def fork(self, source_id: int, seq_id: int) -> None:
        """A new sequence starts as a copy of the source's prompt."""
        self.call(Fork(source_id, seq_id))

    def free(self, seq_ids: list[int]) -> None:
        self.call(Free(seq_ids))

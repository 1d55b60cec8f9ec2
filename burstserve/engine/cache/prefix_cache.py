"""Finished sequences kept in the KV cache, found again by the longest common prefix of a new prompt.

An entry is a finished sequence whose pages stay on every worker: its token ids (prompt and
generated tokens whose K/V were computed) and its sequence id in the ledger and the pools. Entries
are indexed by a hash chain over blocks of BLOCK tokens (vLLM's scheme: block i's key hashes block
i - 1's key with block i's tokens), so the deepest cached block of a prompt is found in
O(prompt / BLOCK) dictionary lookups; the match is then checked token by token against the entry
(a hash collision never reuses a wrong prefix) and extended inside the next block. The scheduler
evicts entries least recently used first when it needs pages; an entry is copied from, never
shared, so evicting one never touches a running sequence.
"""
import itertools
from collections import OrderedDict
from typing import Iterator

BLOCK = 16          # tokens per hashed block


def chain(tokens: list[int], limit: int | None = None) -> Iterator[int]:
    """The hash chain over the whole blocks of tokens[:limit], one key at a time."""
    key = None
    n = len(tokens) if limit is None else min(limit, len(tokens))
    for start in range(0, n - BLOCK + 1, BLOCK):
        key = hash((key, tuple(tokens[start:start + BLOCK])))
        yield key


def block_keys(tokens: list[int], limit: int | None = None) -> list[int]:
    """The hash chain over the whole blocks of tokens[:limit]."""
    return list(chain(tokens, limit))


class Chain:
    """The hash chain over the whole blocks of tokens[:limit], computed as far as it is read, once: one
    prompt looked up in the pool's prefix cache and the host tier's hashes each block once."""

    def __init__(self, tokens: list[int], limit: int | None = None):
        self._next, self.keys = chain(tokens, limit), []

    def __iter__(self) -> Iterator[int]:
        yield from list(self.keys)
        for key in self._next:
            self.keys.append(key)
            yield key


class PrefixCache:
    def __init__(self):
        self.entries: OrderedDict[int, list[int]] = OrderedDict()   # seq_id -> tokens; least recently used first
        self.index: dict[int, set[int]] = {}                        # block key -> entries holding that prefix
        self.used: dict[int, int] = {}                             # seq_id -> tick of its last use
        self.tick = 0
        self.queries = 0            # prompt tokens looked up
        self.hits = 0               # of those, found cached

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, seq_id: int) -> None:
        """The entry becomes the most recently used."""
        self.entries.move_to_end(seq_id)
        self.tick += 1
        self.used[seq_id] = self.tick

    def insert(self, seq_id: int, tokens: list[int], keys: Chain | None = None) -> None:
        """A new entry (keys: the Chain of its tokens, if the caller has one)."""
        self.entries[seq_id] = list(tokens)
        self.touch(seq_id)
        for key in keys if keys is not None else chain(tokens):
            self.index.setdefault(key, set()).add(seq_id)

    def remove(self, seq_id: int) -> None:
        tokens = self.entries.pop(seq_id)
        del self.used[seq_id]
        self._unindex(seq_id, block_keys(tokens))

    def truncate(self, seq_id: int, length: int) -> None:
        """The entry keeps its first `length` tokens (the scheduler freed the rest of its pages)."""
        tokens = self.entries[seq_id]
        self._unindex(seq_id, block_keys(tokens)[length // BLOCK:])
        del tokens[length:]

    def _unindex(self, seq_id: int, keys: list[int]) -> None:
        for key in keys:
            holders = self.index.get(key)
            if holders is not None:
                holders.discard(seq_id)
                if not holders:
                    del self.index[key]

    def _indexed_keys(self, tokens: list[int], limit: int, keys: Chain | None = None) -> list[int]:
        """The hash chain over tokens[:limit]'s whole blocks (`keys`, if given, is it) as far as the index
        holds it: an entry that shares a longer prefix holds every shorter one's key too, so a miss costs
        one block's hash, not the whole prompt's."""
        return list(itertools.takewhile(self.index.__contains__, keys if keys is not None else chain(tokens, limit)))

    def lookup(self, prompt: list[int]) -> tuple[int, int] | None:
        """(entry, L): the entry sharing the longest prefix with the prompt and that prefix's length, at
        most len(prompt) - 1 (the last prompt token is always computed: its logits give the first
        token), or None if no entry shares a whole block. The entry becomes the most recently used."""
        self.queries += len(prompt)
        hit = self.longest(prompt)
        if hit is not None:
            self.touch(hit[0])
            self.hits += hit[1]
        return hit

    def longest(self, prompt: list[int], limit: int | None = None, keys: Chain | None = None,
                skip: int | None = None) -> tuple[int, int] | None:
        """lookup's answer, without counting the query or touching the entry (for the scheduler's eviction
        order: the entry a waiting prompt would copy from is evicted last). limit: the longest prefix
        wanted (default len(prompt) - 1); keys: the prompt's Chain to that limit, if the caller has one;
        skip: an entry not to answer with."""
        best = None
        limit = len(prompt) - 1 if limit is None else limit
        keys = self._indexed_keys(prompt, limit, keys)
        for depth in range(len(keys), 0, -1):
            holders = sorted((e for e in self.index.get(keys[depth - 1], ()) if e != skip), key=self.used.__getitem__,
                             reverse=True)
            for seq_id in holders:                          # most recently used first
                if self.entries[seq_id][:depth * BLOCK] == prompt[:depth * BLOCK]:    # never trust the hash alone
                    best = (seq_id, depth * BLOCK)
                    break
            if best is not None:
                break
        if best is None:
            return None
        seq_id, matched = best
        tokens, limit = self.entries[seq_id], min(len(self.entries[seq_id]), limit)
        while matched < limit and tokens[matched] == prompt[matched]:
            matched += 1
        return seq_id, matched

"""Where a sequence's tokens go over the workers: the placement vocabulary both sides of the wall speak.

The scheduler's side (engine/cache/page_planner.py) decides it; the workers (the strategies in engine/parallel/,
engine/runner/extend_attention.py) run what it says. A leaf: it imports nothing of the engine.

Zigzag shards: a prompt is cut into 2G chunks whose sizes differ by at most one; worker r holds chunks r and
2G-1-r, so at every ring step every worker does the same amount of causal work. Any length works: with fewer
than 2G tokens some chunks (and maybe whole workers) are empty.

An extend (a chunk of a prompt after its first, or a prompt beyond its cached prefix) runs in one of three
ways (ExtendWay): "local" (one worker, or replicated K/V), "whole" (every worker runs the new tokens, the
worker holding fewest of the sequence keeps their K/V: whole_shards) or "ring" (sharded over the workers,
placed to level their totals: balanced_shards).
"""
from dataclasses import dataclass
from enum import StrEnum

import torch

from burstserve.kernels.arith import ceil_div


class ExtendWay(StrEnum):
    """How an extend runs over the workers (engine/runner/extend_attention.py); its value is its name in the figures."""
    LOCAL = "local"          # one worker, or replicated K/V
    WHOLE = "whole"          # every worker runs the new tokens, one keeps their K/V
    RING = "ring"            # sharded over the workers, the cache seen by passing the queries (pass-Q)
    RING_KV = "ring-kv"      # the same, the cached K/V passed around the ring (pass-KV): reported, never planned


@dataclass(frozen=True)
class Shard:
    rank: int
    first: tuple[int, int]     # [start, end) of chunk r in the prompt
    second: tuple[int, int]    # [start, end) of chunk 2G-1-r

    @property
    def len_first(self) -> int:
        return self.first[1] - self.first[0]

    @property
    def length(self) -> int:
        return self.len_first + self.second[1] - self.second[0]

    def positions(self, device=None) -> torch.Tensor:
        """[length] int64 global positions, in increasing order."""
        return torch.cat([torch.arange(*self.first, device=device), torch.arange(*self.second, device=device)])


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """num_chunks consecutive [start, end) ranges covering num_tokens; sizes differ by at most one."""
    base, extra = divmod(num_tokens, num_chunks)
    bounds, start = [], 0
    for i in range(num_chunks):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def zigzag_shards(num_tokens: int, world_size: int) -> list[Shard]:
    chunks = chunk_bounds(num_tokens, 2 * world_size)
    return [Shard(r, chunks[r], chunks[2 * world_size - 1 - r]) for r in range(world_size)]


def owner_of_position(shards: list[Shard], position: int) -> tuple[int, int]:
    """(rank, local index) of the worker that holds a prompt position."""
    for s in shards:
        if s.first[0] <= position < s.first[1]:
            return s.rank, position - s.first[0]
        if s.second[0] <= position < s.second[1]:
            return s.rank, s.len_first + position - s.second[0]
    raise IndexError(f"position {position} is outside the prompt")


def level_counts(held: list[int], num_tokens: int) -> list[int]:
    """How many of num_tokens new tokens each worker takes so that held + new is as level as possible
    (water-filling: the workers holding fewest first, the lowest rank first among equals)."""
    w = len(held)
    order = sorted(range(w), key=lambda r: (held[r], r))
    remaining = num_tokens
    for k in range(1, w + 1):                  # the k lowest, raised together to the next one's level
        level = held[order[k - 1]]
        room = (held[order[k]] - level) * k if k < w else None
        if room is None or remaining <= room:
            base, extra = divmod(remaining, k)
            take = [0] * w
            for i in range(k):
                take[order[i]] = level - held[order[i]] + base + (1 if i < extra else 0)
            return take
        remaining -= room
    raise AssertionError("unreachable")


def balanced_shards(num_tokens: int, held: list[int]) -> list[Shard]:
    """Shards of num_tokens new positions (0-based) that level the workers' totals (level_counts), in
    zigzag order: rank r's first chunk is the r-th, its second the (2W-1-r)-th, so BurstAttention's
    causal rules hold whatever the sizes. A chunked prefill's chunks, placed so, never pile up on the
    same workers (zigzag_shards gives a chunk's leftover tokens to the low ranks every time)."""
    w = len(held)
    take = level_counts(held, num_tokens)
    sizes = [take[r] // 2 for r in range(w)] + [take[r] - take[r] // 2 for r in reversed(range(w))]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return [Shard(r, bounds[r], bounds[2 * w - 1 - r]) for r in range(w)]


def whole_keeper(held: list[int]) -> int:
    """The worker that keeps a whole extend's K/V: the one holding fewest tokens of the sequence (the
    lowest rank among equals), so that chunk after chunk the workers stay within one chunk of level."""
    return held.index(min(held))


def whole_shards(num_tokens: int, held: list[int]) -> list[Shard]:
    """All num_tokens new positions (0-based) on one worker, whole_keeper(held). For an incremental
    prefill run whole on every worker (engine/runner/extend_attention.py): every worker runs the new tokens,
    and this one keeps their K/V."""
    owner = whole_keeper(held)
    return [Shard(r, (0, num_tokens if r == owner else 0), (num_tokens, num_tokens)) for r in range(len(held))]


def worker_share(tokens: int, world_size: int, replicated_kv: bool) -> int:
    """The most of one sequence's `tokens` one worker holds: all of them on one worker or under replicated K/V
    (tp); else a zigzag shard's, at most one token over an even split (decoded tokens go to the worker holding
    fewest)."""
    return tokens if replicated_kv or world_size == 1 else ceil_div(tokens, world_size) + 1


def contiguous_shards(num_tokens: int, workers: int) -> list[Shard]:
    """Worker w holds token group w (a Shard whose second chunk is empty)."""
    return [Shard(w, (a, b), (b, b)) for w, (a, b) in enumerate(chunk_bounds(num_tokens, workers))]


class ShardLayout(StrEnum):
    """How a strategy cuts a prompt over the workers."""
    ZIGZAG = "zigzag"            # chunks r and 2W-1-r on worker r (zigzag_shards)
    CONTIGUOUS = "contiguous"    # token group w on worker w (contiguous_shards)
    ONE = "one"                  # the whole prompt as one shard, in position order (replicated K/V: tp)


@dataclass(frozen=True)
class PromptPlacement:
    """A prefill strategy's placement of a prompt's K/V, all the scheduler's side needs of it (engine/parallel/
    strategy.py PrefillStrategy.placement)."""
    layout: ShardLayout
    world_size: int
    replicated_kv: bool          # every worker holds every token's K/V (for its own heads)

    @property
    def kv_workers(self) -> int:
        """Workers one sequence's K/V is spread over: the decode all-gather's width, capacity's multiplier."""
        return 1 if self.replicated_kv else self.world_size

    def shards(self, num_tokens: int) -> list[Shard]:
        """The prompt's positions cut into shards, one per rank (ONE: a single shard)."""
        if self.layout == ShardLayout.ONE:
            return zigzag_shards(num_tokens, 1)
        if self.layout == ShardLayout.CONTIGUOUS:
            return contiguous_shards(num_tokens, self.world_size)
        return zigzag_shards(num_tokens, self.world_size)

    def shard_of(self, shards: list[Shard], rank: int) -> Shard:
        """The shard whose tokens this rank runs through the model (and keeps the K/V of)."""
        return shards[0] if self.layout == ShardLayout.ONE else shards[rank]

    def tokens_per_rank(self, shards: list[Shard]) -> list[int]:
        """Prompt tokens each worker stores in its KV cache, by rank."""
        if self.layout == ShardLayout.ONE:
            return [shards[0].length] * self.world_size
        return [s.length for s in shards]

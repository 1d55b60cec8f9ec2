"""Zigzag sharding of one prompt over G workers, for causal load balance.

The prompt is cut into 2G chunks whose sizes differ by at most one; worker r holds chunks r and
2G-1-r, so at every ring step every worker does the same amount of causal work. Any length works:
with fewer than 2G tokens some chunks (and maybe whole workers) are empty.
"""
from dataclasses import dataclass

import torch


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

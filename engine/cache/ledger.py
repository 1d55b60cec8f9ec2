"""Which worker holds how many of each sequence's tokens, and how many pages that takes.

Every worker keeps an identical ledger (the calls that change it reach every worker in the same
order), so worker 0's scheduler can decide admission and preemption for all workers without
asking them. A worker's tokens of one sequence fill `ceil(tokens / block_size)` pages of its pool.
"""
from dataclasses import dataclass


@dataclass
class SequenceLedger:
    tokens: list[int]    # tokens each worker holds, by rank
    prompt: list[int]    # of those, the first ones: the prefilled prompt's shard on each worker


def pages_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class KVLedger:
    def __init__(self, world_size: int, block_size: int, num_pages: int, replicated: bool = False):
        """num_pages: usable pages per worker (the same on every worker); replicated: every worker holds
        every token (tensor parallelism, each for its own heads)."""
        self.world_size, self.block_size, self.num_pages = world_size, block_size, num_pages
        self.replicated = replicated
        self.seqs: dict[int, SequenceLedger] = {}
        self.pages_used = [0] * world_size

    def add(self, seq_id: int, tokens_per_rank: list[int]) -> None:
        self.seqs[seq_id] = SequenceLedger(list(tokens_per_rank), list(tokens_per_rank))
        for r, n in enumerate(tokens_per_rank):
            self.pages_used[r] += pages_for(n, self.block_size)

    def remove(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            for r, n in enumerate(seq.tokens):
                self.pages_used[r] -= pages_for(n, self.block_size)

    def owners_of_next(self, seq_id: int) -> list[int]:
        """The workers that store the sequence's next token: the one holding fewest (lowest rank on
        ties), or all of them when replicated."""
        if self.replicated:
            return list(range(self.world_size))
        tokens = self.seqs[seq_id].tokens
        return [tokens.index(min(tokens))]

    def advance(self, seq_id: int) -> list[int]:
        """Records one more token of the sequence; returns the workers that store it."""
        owners = self.owners_of_next(seq_id)
        seq = self.seqs[seq_id]
        for r in owners:
            if seq.tokens[r] % self.block_size == 0:
                self.pages_used[r] += 1
            seq.tokens[r] += 1
        return owners

    def step_new_pages(self, seq_ids: list[int]) -> list[int]:
        """Pages each worker must take if every one of these sequences gets one more token."""
        need = [0] * self.world_size
        for s in seq_ids:
            tokens = self.seqs[s].tokens
            for r in self.owners_of_next(s):
                need[r] += tokens[r] % self.block_size == 0
        return need

    def free_pages(self) -> list[int]:
        return [self.num_pages - used for used in self.pages_used]

    def tokens_per_worker(self) -> list[int]:
        totals = [0] * self.world_size
        for seq in self.seqs.values():
            for r, n in enumerate(seq.tokens):
                totals[r] += n
        return totals

    def tokens(self, seq_id: int, rank: int) -> int:
        return self.seqs[seq_id].tokens[rank]

    def prompt_tokens(self, seq_id: int) -> list[int]:
        return list(self.seqs[seq_id].prompt)

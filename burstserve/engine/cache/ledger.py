"""Which worker holds how many of each sequence's tokens, and on which of its pages.

One ledger, the KV manager's (engine/cache/kv_manager.py) on worker 0's scheduler side: it places every
call from it and decides admission and preemption for all workers without asking them; the workers
keep none (each call carries what a worker stores, and on which pages). A worker's tokens of one sequence
fill `ceil(tokens / block_size)` pages of its pool, in token order: the ledger picks them from that worker's
free pages (lowest ids first, so that a prompt's pages are runs) and takes them back when the tokens go.
"""
from dataclasses import dataclass

from burstserve.kernels.arith import ceil_div


Ranges = list[tuple[int, int]]    # [start, end) position ranges, increasing


@dataclass
class SequenceLedger:
    tokens: list[int]    # tokens each worker holds, by rank
    prompt: list[int]    # of those, the first ones: the prefilled prompt's shard on each worker
    ranges: list[Ranges] = None   # by rank: the positions of the tokens it holds, in slot order (increasing:
                                  # prefill shards, then chunk shards, then decoded tokens, all later than before)
    pages: list[list[int]] = None  # by rank: the page ids its tokens fill, in token order

    def held_before(self, rank: int, position: int) -> int:
        """How many of the rank's tokens lie before `position`: they are its first slots."""
        return sum(max(0, min(end, position) - start) for start, end in self.ranges[rank])


def truncate(ranges: Ranges, position: int) -> Ranges:
    return [(a, min(b, position)) for a, b in ranges if a < position]


def append_range(ranges: Ranges, start: int, end: int) -> None:
    if end <= start:
        return
    if ranges and ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], end)
    else:
        ranges.append((start, end))


def pages_for(tokens: int, block_size: int) -> int:
    return ceil_div(tokens, block_size)


class KVLedger:
    def __init__(self, world_size: int, block_size: int, num_pages: int, replicated: bool = False,
                 first_page: int = 1):
        """num_pages: usable pages per worker (the same on every worker), ids first_page .. first_page +
        num_pages - 1 (the GPU pool's page 0 is scratch; the host tier's ids start at 0); replicated: every
        worker holds every token (tensor parallelism, each for its own heads)."""
        self.world_size, self.block_size, self.num_pages = world_size, block_size, num_pages
        self.replicated = replicated
        self.seqs: dict[int, SequenceLedger] = {}
        # by rank, a stack of free page ids: the lowest on top
        self._free = [list(range(first_page + num_pages - 1, first_page - 1, -1)) for _ in range(world_size)]

    @property
    def pages_used(self) -> list[int]:
        return [self.num_pages - len(f) for f in self._free]

    def add(self, seq_id: int, tokens_per_rank: list[int], ranges: list[Ranges]) -> list[list[int]]:
        """A new sequence whose first tokens (its prompt, or the cached prefix it starts from) sit on
        each rank at the given positions -> its pages by rank."""
        seq = SequenceLedger([0] * self.world_size, list(tokens_per_rank), [list(r) for r in ranges],
                             [[] for _ in range(self.world_size)])
        self.seqs[seq_id] = seq
        for r, n in enumerate(tokens_per_rank):
            self._grow(seq, r, n)
        return [list(p) for p in seq.pages]

    def _grow(self, seq: SequenceLedger, rank: int, tokens: int) -> list[int]:
        """The rank holds `tokens` of the sequence from now: the pages that takes beyond its own -> those."""
        need = pages_for(tokens, self.block_size) - len(seq.pages[rank])
        free = self._free[rank]
        if need > len(free):
            raise RuntimeError(f"worker {rank} has {len(free)} free pages, {need} asked: the plan did not make room")
        new = [free.pop() for _ in range(need)]
        seq.pages[rank].extend(new)
        seq.tokens[rank] = tokens
        return new

    def _shrink(self, seq: SequenceLedger, rank: int, tokens: int) -> None:
        """The rank keeps the sequence's first `tokens`: its pages after them are free again."""
        keep = pages_for(tokens, self.block_size)
        self._free[rank].extend(reversed(seq.pages[rank][keep:]))
        del seq.pages[rank][keep:]
        seq.tokens[rank] = tokens

    def add_prefix_of(self, source_id: int, seq_id: int, position: int, tier: "KVLedger | None" = None) -> list[int]:
        """A new sequence holding, on every rank, the copy of the source's tokens before `position`
        (its first slots there) -> those counts by rank. tier: the ledger the source is in (the host
        tier's, engine/pages/host_pool.py), if not this one."""
        source = (tier or self).seqs[source_id]
        counts = [source.held_before(r, position) for r in range(self.world_size)]
        self.add(seq_id, counts, [truncate(source.ranges[r], position) for r in range(self.world_size)])
        return counts

    def truncate(self, seq_id: int, position: int) -> list[int]:
        """Keeps only the sequence's tokens before `position` (its first slots on every rank: they are in
        position order) -> the tokens each rank keeps."""
        seq = self.seqs[seq_id]
        kept = [seq.held_before(r, position) for r in range(self.world_size)]
        for r, n in enumerate(kept):
            self._shrink(seq, r, n)
            seq.prompt[r] = min(seq.prompt[r], n)
            seq.ranges[r] = truncate(seq.ranges[r], position)
        return kept

    def held_before(self, seq_id: int, position: int) -> list[int]:
        """By rank, how many of the sequence's tokens lie before `position`."""
        seq = self.seqs[seq_id]
        return [seq.held_before(r, position) for r in range(self.world_size)]

    def pages_freed_by_truncating(self, seq_id: int, position: int) -> list[int]:
        """The pages each rank would give back if the sequence kept only its tokens before `position`."""
        seq = self.seqs[seq_id]
        return [pages_for(seq.tokens[r], self.block_size) - pages_for(seq.held_before(r, position), self.block_size)
                for r in range(self.world_size)]

    def remove(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            for r in range(self.world_size):
                self._shrink(seq, r, 0)

    def extend(self, seq_id: int, tokens_per_rank: list[int], ranges: list[Ranges]) -> list[list[int]]:
        """Records more of the sequence's prompt on each worker (the next chunk: its positions by rank) -> the
        pages each worker takes for them, by rank."""
        seq = self.seqs[seq_id]
        new = []
        for r, n in enumerate(tokens_per_rank):
            new.append(self._grow(seq, r, seq.tokens[r] + n))
            seq.prompt[r] += n
            for start, end in ranges[r]:
                append_range(seq.ranges[r], start, end)
        return new

    def extend_new_pages(self, seq_id: int, tokens_per_rank: list[int]) -> list[int]:
        """Pages each worker must take to store tokens_per_rank more tokens of the sequence."""
        tokens = self.seqs[seq_id].tokens
        return [pages_for(t + n, self.block_size) - pages_for(t, self.block_size) for t, n in zip(tokens, tokens_per_rank)]

    def owners_of_next(self, seq_id: int) -> list[int]:
        """The workers that store the sequence's next token: the one holding fewest (lowest rank on
        ties), or all of them when replicated."""
        if self.replicated:
            return list(range(self.world_size))
        tokens = self.seqs[seq_id].tokens
        return [tokens.index(min(tokens))]

    def advance(self, seq_id: int) -> tuple[list[int], list[int]]:
        """Records one more token of the sequence -> (the workers that store it, the page each of them takes
        for it: 0 where it fits in the worker's last page)."""
        owners = self.owners_of_next(seq_id)
        seq = self.seqs[seq_id]
        position = seq.tokens[0] if self.replicated else sum(seq.tokens)
        new = []
        for r in owners:
            if seq.tokens[r] % self.block_size == 0:             # its last page is full (or it has none)
                new.append(self._grow(seq, r, seq.tokens[r] + 1)[0])
            else:
                seq.tokens[r] += 1
                new.append(0)
            append_range(seq.ranges[r], position, position + 1)
        return owners, new

    def step_new_pages(self, seq_ids: list[int]) -> list[int]:
        """Pages each worker must take if every one of these sequences gets one more token."""
        need = [0] * self.world_size
        for s in seq_ids:
            tokens = self.seqs[s].tokens
            for r in self.owners_of_next(s):
                need[r] += tokens[r] % self.block_size == 0
        return need

    def free_pages(self) -> list[int]:
        return [len(f) for f in self._free]

    def page_ids(self, seq_id: int, rank: int) -> list[int]:
        """The pages the rank's tokens of the sequence fill, in token order."""
        return list(self.seqs[seq_id].pages[rank])

    def tokens_per_worker(self, skip: set[int] = frozenset(), only: set[int] | None = None) -> list[int]:
        """Tokens held on each worker by every sequence, but those in `skip` (or only those in `only`)."""
        totals = [0] * self.world_size
        for seq_id, seq in self.seqs.items():
            if seq_id in skip or (only is not None and seq_id not in only):
                continue
            for r, n in enumerate(seq.tokens):
                totals[r] += n
        return totals

    def pages_of(self, seq_id: int, rank: int) -> int:
        return pages_for(self.seqs[seq_id].tokens[rank], self.block_size)

    def tokens(self, seq_id: int, rank: int) -> int:
        return self.seqs[seq_id].tokens[rank]

    def prompt_tokens(self, seq_id: int) -> list[int]:
        return list(self.seqs[seq_id].prompt)

    def prompt_ranges(self, seq_id: int) -> list[Ranges]:
        seq = self.seqs[seq_id]
        return [_first_tokens(seq.ranges[r], seq.prompt[r]) for r in range(self.world_size)]


def _first_tokens(ranges: Ranges, count: int) -> Ranges:
    """The ranges of the first `count` positions listed."""
    out = []
    for a, b in ranges:
        if count <= 0:
            break
        out.append((a, min(b, a + count)))
        count -= b - a
    return out

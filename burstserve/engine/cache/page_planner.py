"""Where a sequence's new tokens go over the workers, and how many pages that takes on each.

Pure arithmetic over a strategy's sharding and a ledger (engine/cache/ledger.py), changing nothing: the
scheduler's KV manager (engine/cache/kv_manager.py) asks it what a call will take (planning) and where a
call's tokens go (`place`, just before the call runs), over the same ledger, so a plan and the placement
it predicts agree.

An extend's way and shards: engine/core/placement.py (ExtendWay).
"""
from burstserve.engine.cache.ledger import KVLedger, Ranges, pages_for
from burstserve.engine.core.placement import ExtendWay, PromptPlacement, balanced_shards, whole_keeper, whole_shards


class PagePlanner:
    def __init__(self, placement: PromptPlacement, ledger: KVLedger, max_pages_per_seq: int,
                 extend_ring_min_tokens: int):
        """placement: the prefill strategy's (engine/core/placement.py); max_pages_per_seq: the pages one sequence may
        hold on a worker (the page pool's block table width)."""
        self.placement, self.ledger = placement, ledger
        self.world_size, self.block_size = ledger.world_size, ledger.block_size
        self.max_pages_per_seq = max_pages_per_seq
        self.extend_ring_min_tokens = extend_ring_min_tokens

    # where tokens go

    def prefill_shards(self, num_tokens: int):
        """A prompt of num_tokens over the workers (the strategy's shards)."""
        return self.placement.shards(num_tokens)

    def extend_way(self, num_tokens: int, held: list[int], reserved: list[int] | None = None) -> ExtendWay:
        """How an extend of num_tokens new tokens runs over workers holding `held` tokens of the sequence:
        "local" on one worker or under replicated K/V; "whole" below --extend-ring-min-tokens when the keeper
        (the worker holding fewest) has the pages free (beyond `reserved` pages per worker: a decode step's
        in the same call) and stays within the pages one sequence may hold on a worker, so a whole chunk
        never takes a worker past its pages; else "ring" (level placement)."""
        if self.world_size == 1 or self.placement.replicated_kv:
            return ExtendWay.LOCAL
        if num_tokens >= self.extend_ring_min_tokens:
            return ExtendWay.RING
        keeper = whole_keeper(held)                                      # whole_shards places them there
        after = pages_for(held[keeper] + num_tokens, self.block_size)
        free = self.ledger.free_pages()[keeper] - (reserved[keeper] if reserved else 0)
        fits = after - pages_for(held[keeper], self.block_size) <= free and after <= self.max_pages_per_seq
        return ExtendWay.WHOLE if fits else ExtendWay.RING

    def extend_shards(self, held: list[int], num_tokens: int, way: ExtendWay):
        """Where an extend's new tokens go, over workers holding `held` tokens of the sequence, for its way
        (page plans pass "ring"): "whole": all on the worker holding fewest; "ring": in zigzag order, sized to
        level the workers' totals; under replicated K/V, the strategy's one shard."""
        if self.placement.replicated_kv:
            return self.placement.shards(num_tokens)
        return whole_shards(num_tokens, held) if way == ExtendWay.WHOLE else balanced_shards(num_tokens, held)

    def ranges(self, shards, offset: int) -> list[Ranges]:
        """By rank, the positions (offset + shard ranges) each worker stores of a prefill or a chunk."""
        def of(s) -> Ranges:
            return [(s.first[0] + offset, s.first[1] + offset), (s.second[0] + offset, s.second[1] + offset)]
        if self.placement.replicated_kv:
            return [of(shards[0]) for _ in range(self.world_size)]
        return [of(s) for s in shards]

    def tokens_per_rank(self, shards) -> list[int]:
        return self.placement.tokens_per_rank(shards)

    # what a call will take (pages per worker)

    def prefill_pages(self, num_tokens: int) -> list[int]:
        """To prefill a prompt of num_tokens in one call."""
        return [pages_for(n, self.block_size) for n in self.tokens_per_rank(self.prefill_shards(num_tokens))]

    def chunk_pages(self, seq_id: int | None, num_tokens: int, reserved: list[int] | None = None) -> list[int]:
        """For the next num_tokens of a prompt prefilled in chunks (seq_id None: its first chunk, a prefill);
        reserved: pages per worker a decode step in the same call takes (the chunk is placed beside them)."""
        if seq_id is None:
            return self.prefill_pages(num_tokens)
        held = self.ledger.seqs[seq_id].tokens
        shards = self.extend_shards(held, num_tokens, self.extend_way(num_tokens, held, reserved))
        return self.ledger.extend_new_pages(seq_id, self.tokens_per_rank(shards))

    def pages_after(self, held: list[int], num_tokens: int, chunk: int | None) -> list[int]:
        """Pages each worker holds once a sequence holding `held` tokens by rank is extended by num_tokens in
        chunks of `chunk` (None: one extend), each chunk placed level, as the ring places them (a chunk run
        whole goes only where its pages are free: see extend_way)."""
        held = list(held)
        while num_tokens > 0:
            n = min(chunk or num_tokens, num_tokens)
            take = self.tokens_per_rank(self.extend_shards(held, n, ExtendWay.RING))   # plans: level
            held = [h + t for h, t in zip(held, take)]
            num_tokens -= n
        return [pages_for(h, self.block_size) for h in held]

    def growth_pages(self, seq_id: int, num_tokens: int, chunk: int | None) -> list[int]:
        """Pages each worker takes beyond what the sequence holds to extend it by num_tokens in chunks."""
        final = self.pages_after(self.ledger.seqs[seq_id].tokens, num_tokens, chunk)
        return [f - self.ledger.pages_of(seq_id, r) for r, f in enumerate(final)]

    def chunked_prefill_pages(self, num_tokens: int, chunk: int) -> list[int]:
        """To prefill a prompt of num_tokens in chunks of `chunk` (the first a prefill)."""
        first = min(chunk, num_tokens)
        held = self.tokens_per_rank(self.prefill_shards(first))
        return self.pages_after(held, num_tokens - first, chunk)

    def adopt_pages(self, source_id: int, position: int, num_tokens: int, chunk: int | None,
                    tier: KVLedger | None = None) -> list[int]:
        """To copy the source's tokens before `position` and extend the copy by num_tokens in chunks. tier:
        the ledger the source is in (the host tier's), if not the pool's."""
        return self.pages_after((tier or self.ledger).held_before(source_id, position), num_tokens, chunk)

    def fork_pages(self, source_id: int) -> list[int]:
        """To copy the source's prompt (its shard on each worker)."""
        return [pages_for(n, self.block_size) for n in self.ledger.prompt_tokens(source_id)]

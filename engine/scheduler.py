"""Worker 0's loop: admit requests, prefill one at a time across all workers, decode the running
ones together in one batch, sample, and send each token back as soon as it exists.

KV pages (engine/cache): a request is admitted when its prompt's pages fit on every worker (with a
small watermark left for the running sequences to grow); nothing is reserved for the tokens it may
generate. When a decode step needs more pages than a worker has free, the newest running sequence
is preempted and later resumed, before any new request. With the prefix cache its pages stay as an
entry, evicted like any other (least recently used first, from its tail: an entry gives back only the
pages needed, keeping its longest prefix); it takes back what is left of them and recomputes only the
rest (nothing when no one needed them). Otherwise its pages are freed and its prompt and generated
tokens are prefilled again as a prompt is (from the longest prefix the prefix cache holds, in chunks
when longer than --max-num-batched-tokens, so a long sequence's recompute does not stop the others'
streams), after which it goes on sampling; a seeded request's noise depends only on its
seed and the token's index (engine/sampling.py), so a seeded or greedy request gives the same tokens
as if it had never been preempted (vLLM's recompute preemption).

Sampling: a decode step's tokens are drawn on worker 0's device for the whole batch (greedy,
temperature, top-k, top-p; logprobs there too); only the rows under a grammar (response_format)
come to the host, masked and sampled by the same rule."""
import array
import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.outputs import Request, StepOutput
from engine.calls import (Adopt, Decode, DecodeAhead, DecodeResult, Extend, ExtendAndDecode, Fork, Free, Prefill,
                          PrefillResult, Reinstate, Retire, Truncate)
from engine.cache.prefix_cache import BLOCK, PrefixCache
from engine.chunk_sizer import ChunkSizer, attention_flop_ratio, min_chunk_tokens
from engine.sampling import RowSampling, row_sampling, rows_logprobs, sample_rows
from engine.structured_output import GrammarBackend, SequenceGrammar, TokenizerSource, mask_logits

log = logging.getLogger(__name__)


def token_tensor(ids: list[int]) -> torch.Tensor:
    """[n] int64 of a list of token ids, through an array (a third of torch.tensor's time on a long prompt)."""
    return torch.frombuffer(array.array("q", ids), dtype=torch.int64) if ids else torch.empty(0, dtype=torch.int64)


@dataclass
class RunningSequence:
    request: Request
    seq_id: int
    generated: list[int] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None    # [V] fp32, the prefill's: a twin's first token samples from it
    grammar: SequenceGrammar | None = None       # response_format: masks what this sequence may sample
    preemptions: int = 0                         # times preempted (its cache now starts with prompt + generated)

    def sampling(self) -> RowSampling:
        """How its next token is sampled (seeded requests: the same noise for the same token index)."""
        return row_sampling(self.request.params, len(self.generated))


@dataclass
class ChunkedPrefill:
    seq: RunningSequence
    tokens: list[int]             # what it prefills: the prompt, or a preempted sequence's prompt + generated
    done: int = 0                 # of those, already in the KV cache
    cached: int = 0               # of those, taken from the prefix cache (the first chunk extends them)
    chunks: int = 0
    prefill_seconds: float = 0.0  # the workers' time over all chunks
    call_seconds: float = 0.0
    smallest: int = 0             # its smallest and largest chunk, in tokens
    largest: int = 0
    adopt_seconds: float = 0.0    # finding the cached prefix and copying it (worker 0's view)
    queued_seconds: float = 0.0   # from its arrival to this scheduler taking it up
    extend_ways: dict = field(default_factory=dict)   # incremental prefills by way ("local", "whole", "ring")
    graphed: int = 0              # of them, replayed as CUDA graphs (engine/extend_graphs.py)
    mixed: int = 0                # of them, with the running sequences' decode step in the same call

    @property
    def resumed(self) -> bool:
        """Recomputing a preempted sequence (its next token continues its output; no first-token stats)."""
        return bool(self.seq.generated)


@dataclass
class StepInFlight:
    """A decode step launched and not yet read back (asynchronous scheduling: see Scheduler._decode_ahead)."""
    batch: list[RunningSequence]
    pending: object               # worker 0's engine.step_tokens.PendingTokens
    fed: bool                     # its input tokens were the step before it's, on the device
    launched: float               # time.perf_counter() at its launch


def mixed_batch_limit(runner) -> int | None:
    """The largest chunk that runs with a decode step in one forward pass: --mixed-batch as asked (any chunk; 0
    with --no-mixed-batch), or by default (None) the chunks that worker 0 replays with a decode step as one
    CUDA graph (engine/extend_graphs.py; every worker decides alike), 0 where none: one graph of a late
    chunk and the decode step beats the two graphs apart, while an eager mixed pass is bound by the host and
    slower than both (docs/benchmarks.md, Chunked prefill and interference)."""
    asked = runner.engine.mixed_batch
    if asked is not None:
        return None if asked else 0
    graphs = getattr(runner, "extend_graphs", None)
    return graphs.mixed_max_tokens if graphs is not None else 0


class Scheduler:
    def __init__(self, call: Callable, requests: "queue.Queue", outputs: "queue.Queue", max_num_seqs: int,
                 max_model_len: int, eos_token_ids: list[int], kv):
        """kv: worker 0's ModelRunner, for its KV ledger (the same on every worker) and prefill_pages."""
        self.call, self.requests, self.outputs = call, requests, outputs
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.kv, self.ledger = kv, kv.ledger
        self.kv_capacity_per_worker = self.ledger.num_pages * self.ledger.block_size
        self.watermark = max(1, self.ledger.num_pages // 100)   # pages kept free for running sequences to grow
        self.num_preemptions = 0
        self.recomputed_tokens = 0                              # prefilled again after preemptions (cache hits not)
        self._step_outputs: list[StepOutput] | None = None    # collecting a decode step's outputs
        self._published: tuple | None = None
        self._published_at = 0.0
        self.waiting: deque[Request] = deque()
        self.preempted: deque[RunningSequence] = deque()        # to recompute, oldest first, before new requests
        self.running: list[RunningSequence] = []
        self.aborted: set[str] = set()
        self.next_seq_id = 0
        self.chunk_tokens = kv.engine.max_num_batched_tokens    # None: a prompt is prefilled in one call
        target = kv.engine.itl_target_ms
        self.sizer = ChunkSizer(self.chunk_tokens, target / 1e3 if target else None, attention_flop_ratio(kv.cfg),
                                self.ledger.block_size, min_chunk_tokens(kv.device.type)) if self.chunk_tokens else None
        self.step_seconds = 0.0                                 # the last decode step, as this loop saw it
        self.short_went_first = False                           # the last turn went to a short prompt, not a chunk
        self.mixed_limit = mixed_batch_limit(kv)                # a chunk up to this (None: any) and the others'
        self.mixed = self.mixed_limit != 0                      # decode step in one call
        self.prefix_cache = PrefixCache() if kv.engine.enable_prefix_caching else None
        self.prefilling: ChunkedPrefill | None = None           # the prompt being prefilled chunk by chunk
        self.async_scheduling = kv.engine.async_scheduling      # a decode step launched before the last is read
        self.inflight: StepInFlight | None = None                # that step, launched, its tokens not yet read
        self._collected_at = 0.0                                 # when the last step in flight was read back
        self.grammars: dict[TokenizerSource, GrammarBackend] = {}   # built at the first response_format

    def run(self) -> None:
        while True:
            self._publish_stats()
            if not self._poll(block=not (self.waiting or self.running or self.preempted or self.prefilling
                                         or self.inflight)):
                self._drain()
                return
            if self.inflight is not None:
                if self._decodes_on():                # the next step launched before the one in flight is read
                    self._decode_ahead()
                    continue
                self._drain()                         # what comes next needs every token read back
            self._drop_aborted()
            if self.prefilling is not None:           # a long prompt's next chunk, then a step of the others
                if not self.short_went_first and self._short_head_goes_first():
                    self._prefill(self.waiting.popleft())
                    self.short_went_first = True       # then a chunk: short requests cannot starve the long one
                    if self.running:
                        self._decode()
                else:
                    self.short_went_first = False
                    if not (self.mixed and self.running and self._chunk_with_decode()):
                        self._prefill_chunk()
                        if self.running:
                            self._decode()
            elif self.preempted and self._can_resume(self.preempted[0]):
                self._resume(self.preempted.popleft())
            elif not self.preempted and self.waiting and self._can_admit_request(self.waiting[0]):
                self._prefill(self.waiting.popleft())
            elif self.running:
                self._decode()
            elif self.preempted or self.waiting:     # alone and still too large: refused up front, so never
                self._refuse_head()

    def _can_admit(self, num_tokens: int, prompt: list[int] | None = None) -> bool:
        """First come, first served: the head waits for a batch slot and for its prompt's pages on every
        worker, leaving the watermark free while others run (prompt: see _fits)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        keep = self.watermark if self.running else 0
        return self._fits([n + keep for n in self.kv.prefill_pages(num_tokens)], prompt=prompt)

    def _short_head_goes_first(self) -> bool:
        """While a long prompt prefills in chunks, may the first waiting request be prefilled before its
        next chunk? Yes when it is one chunk's worth (not chunked itself) and fits beside the pages the
        long prompt's remaining chunks will take: a short request is not stuck behind a long one."""
        if self.preempted or not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        request = self.waiting[0]
        if not self._short(request):
            return False
        keep = self.watermark if self.running else 0
        need = self.kv.prefill_pages(len(request.prompt_token_ids))
        return self._fits([n + keep + r for n, r in zip(need, self._prefilling_reserve())],
                          prompt=request.prompt_token_ids)

    def _short(self, request: Request) -> bool:
        """At most one chunk's worth of tokens (a prompt-logprobs request, never chunked, may be longer)."""
        return self.chunk_tokens is not None and len(request.prompt_token_ids) <= self.chunk_tokens

    def _prefilling_reserve(self) -> list[int]:
        """Pages per worker the prompt being prefilled in chunks still takes (zeros when none): what a
        request admitted beside it must leave free. One page more than planned: its chunks' sizes adapt."""
        job = self.prefilling
        if job is None:
            return [0] * self.ledger.world_size
        held = [self.ledger.tokens(job.seq.seq_id, r) for r in range(self.ledger.world_size)]
        final = self.kv.plan_pages(held, len(job.tokens) - job.done, self.chunk_tokens)
        return [max(0, f + 1 - self.ledger.pages_of(job.seq.seq_id, r)) for r, f in enumerate(final)]

    def _fits_beside(self, need: list[int], keep_entry: int | None = None) -> bool:
        """_fits for a request admitted while a long prompt prefills: the pages it still needs stay free."""
        return self._fits([n + r for n, r in zip(need, self._prefilling_reserve())], keep_entry)

    def _can_resume(self, seq: RunningSequence) -> bool:
        """_can_admit for a preempted sequence: taking its entry back needs a batch slot and the watermark;
        a recompute, its pages (chunked when longer than a chunk)."""
        kept = self._kept(seq)
        if kept:
            if len(self.running) >= self.max_num_seqs:
                return False
            keep = self.watermark if self.running else 0
            if kept == self._tokens_to_recompute(seq) - 1:   # whole: its next token's page, else the next step
                need = self.ledger.step_new_pages([seq.seq_id])  # would preempt it again
            else:                                             # the pages its recomputed tail takes
                held = self.ledger.seqs[seq.seq_id].tokens
                final = self.kv.plan_pages(held, self._tokens_to_recompute(seq) - kept, self.chunk_tokens)
                need = [f - self.ledger.pages_of(seq.seq_id, r) for r, f in enumerate(final)]
            return self._fits([keep + n for n in need], keep_entry=seq.seq_id)
        n = self._tokens_to_recompute(seq)
        return self._can_admit_tokens(n, self._chunk_long(n), seq.request.prompt_token_ids)

    def _can_admit_request(self, request: Request) -> bool:
        """_can_admit for a new request's prompt, chunked or not."""
        ids = request.prompt_token_ids
        return self._can_admit_tokens(len(ids), self._chunked(request), ids)

    def _can_admit_tokens(self, n: int, chunked: bool, prompt: list[int]) -> bool:
        """_can_admit for n tokens to prefill, in one call or in chunks (pages as its chunks place them);
        prompt: their first tokens (see _fits)."""
        if not chunked:
            return self._can_admit(n, prompt)
        if len(self.running) >= self.max_num_seqs:
            return False
        keep = self.watermark if self.running else 0
        # planned with chunks of chunk_tokens; adapted sizes end as level (every worker within one token of
        # N / workers), so on a cache with no running sequences the plan's largest share always fits
        return self._fits([p + keep for p in self.kv.chunked_prefill_pages(n, self.chunk_tokens)], prompt=prompt)

    def _fits(self, need: list[int], keep_entry: int | None = None, prompt: list[int] | None = None) -> bool:
        """Do `need` pages fit on every worker, after evicting prefix-cache entries (least recently used
        first, never `keep_entry`; preempted sequences' entries after all others, the last to resume
        first: they will be resumed)? Evicts nothing when even evicting every entry would not do. With
        `prompt` (what the pages are for), the entry holding its longest cached prefix goes last: the
        prompt copies it once admitted, so a document's questions keep the document however recently
        other sequences finished."""
        free = self.ledger.free_pages()
        if all(n <= f for n, f in zip(need, free)):
            return True
        entries = [e for e in (self.prefix_cache.entries if self.prefix_cache else ()) if e != keep_entry]
        evictable = [sum(self.ledger.pages_of(e, r) for e in entries) for r in range(len(free))]
        if not all(n <= f + e for n, f, e in zip(need, free, evictable)):
            return False
        hit = self.prefix_cache.longest(prompt) if prompt else None
        if hit is not None and hit[0] in entries:
            entries.remove(hit[0])
            entries.append(hit[0])
        preempted = [s.seq_id for s in reversed(self.preempted) if s.seq_id in entries]
        entries = [e for e in entries if e not in preempted] + preempted
        for entry in entries:                          # least recently used first
            short = [max(0, n - f) for n, f in zip(need, self.ledger.free_pages())]
            if not any(short):
                break
            self._evict_pages(entry, short)
        return True

    def _evict_pages(self, seq_id: int, short: list[int]) -> None:
        """Frees at least `short` pages per worker from a prefix-cache entry: from its tail when keeping a
        prefix of whole hashed blocks leaves enough (the longest such prefix kept: a long document loses
        only what is needed, a preempted sequence recomputes only that), else the whole entry."""
        def enough(blocks: int) -> bool:
            freed = self.ledger.pages_freed_by_truncating(seq_id, blocks * BLOCK)
            return all(f >= s for f, s in zip(freed, short))

        lo, hi = 1, len(self.prefix_cache.entries[seq_id]) // BLOCK   # the most blocks kept that free enough
        if hi < 1 or not enough(lo):
            self._evict(seq_id)
            return
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if enough(mid) else (lo, mid - 1)
        self.prefix_cache.truncate(seq_id, lo * BLOCK)
        self.call(Truncate(seq_id, lo * BLOCK))

    def _evict(self, seq_id: int) -> None:
        self.prefix_cache.remove(seq_id)
        self.call(Free([seq_id]))

    def _refuse_head(self) -> None:
        """Nothing runs and the first waiting sequence still does not fit: LLM.submit refuses any request
        larger than an empty cache (check_fits), so this is a bug, said loudly rather than a silent hang."""
        seq_tokens = (self._tokens_to_recompute(self.preempted[0]) if self.preempted
                      else len(self.waiting[0].prompt_token_ids))
        raise RuntimeError(f"a sequence of {seq_tokens} tokens does not fit in the empty KV cache "
                           f"({self.ledger.free_pages()} free pages per worker); LLM.check_fits should have refused it")

    def _kept(self, seq: RunningSequence) -> int:
        """How many of a preempted sequence's tokens its prefix-cache entry still holds (0: none, or no
        entry): the prompt and generated tokens but the last when no one took any of its pages."""
        if self.prefix_cache is None or seq.seq_id not in self.prefix_cache.entries:
            return 0
        return len(self.prefix_cache.entries[seq.seq_id])

    @staticmethod
    def _tokens_to_recompute(seq: RunningSequence) -> int:
        return len(seq.request.prompt_token_ids) + len(seq.generated)

    def _publish_stats(self) -> None:
        """Sends worker 0's figures when they change (at most every 0.25 s while busy)."""
        cache = self.prefix_cache
        entries = set(cache.entries) if cache else set()
        kv = self.ledger.tokens_per_worker(skip=entries)         # in use; prefix-cache entries count as free (vLLM)
        waiting = len(self.waiting) + len(self.preempted) + (self.prefilling is not None)
        state = (len(self.running), waiting, tuple(kv), self.num_preemptions,
                 cache.queries if cache else 0, cache.hits if cache else 0, self.recomputed_tokens)
        now = time.monotonic()
        if state == self._published or (now - self._published_at < 0.25 and self.running and
                                        state[:2] == self._published[:2]):
            return
        self._published, self._published_at = state, now
        self.outputs.put(("stats", {"running": state[0], "waiting": state[1], "kv_tokens_per_worker": kv,
                                    "kv_capacity_per_worker": self.kv_capacity_per_worker,
                                    "kv_pages_free": self.ledger.free_pages(), "num_preemptions": state[3],
                                    "prefix_cache_queries": state[4], "prefix_cache_hits": state[5],
                                    "num_recomputed_tokens": state[6],
                                    "kv_tokens_cached_per_worker": self.ledger.tokens_per_worker(only=entries)}))

    def _poll(self, block: bool) -> bool:
        """Takes every pending message; False on shutdown."""
        while True:
            try:
                msg = self.requests.get(timeout=0.5) if block else self.requests.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            if msg[0] == "shutdown":
                return False
            if msg[0] == "add":
                self.waiting.append(msg[1])
            elif msg[0] == "abort":
                self.aborted.add(msg[1])

    def _drop_aborted(self) -> None:
        if not self.aborted:
            return
        self.waiting = deque(r for r in self.waiting if r.request_id not in self.aborted)
        for seq in [s for s in self.preempted if s.request.request_id in self.aborted]:
            if self._kept(seq):                       # its pages, kept as an entry: freed as an abort's are
                self._evict(seq.seq_id)
        self.preempted = deque(s for s in self.preempted if s.request.request_id not in self.aborted)
        gone = [s for s in self.running if s.request.request_id in self.aborted]
        if gone:
            self._free(gone)
            self.running = [s for s in self.running if s.request.request_id not in self.aborted]
        if self.prefilling is not None and self.prefilling.seq.request.request_id in self.aborted:
            self._free([self.prefilling.seq])
            self.prefilling = None
        self.aborted.clear()

    def _prefill(self, request: Request) -> None:
        queued = time.time() - request.arrival_time
        seq = RunningSequence(request, self.next_seq_id, grammar=self._grammar(request))
        self.next_seq_id += 1
        twin = self._running_twin(request)
        if twin is not None and not self._fits_beside(self.kv.fork_pages(twin.seq_id)):
            twin = None                                  # its copy does not fit: a prefill, as admitted
        cached = 0
        looked_up = time.perf_counter()
        if twin is None and self.prefix_cache is not None and request.params.prompt_logprobs is None:
            cached = self._adopt_cached_prefix(seq, request.prompt_token_ids, self.chunk_tokens)
        if twin is None and (cached or self._chunked(request)):   # prefilled by extending what is cached
            job = ChunkedPrefill(seq, request.prompt_token_ids, done=cached, cached=cached,
                                 adopt_seconds=time.perf_counter() - looked_up, queued_seconds=queued)
            if self.prefilling is None:
                self.prefilling = job
                self._prefill_chunk()
            else:           # a short prompt beside a long one (_short_head_goes_first): its rest in one call
                self._advance(job, len(request.prompt_token_ids) - cached)
            return
        if twin is not None:   # the same prompt is already in the cache: copy its K/V instead of a prefill
            self.call(Fork(twin.seq_id, seq.seq_id))
            logits, stats, prompt_logprobs = twin.prompt_logits, {"prefill_seconds": 0.0, "shared_prefill": True}, None
        else:
            called = time.perf_counter()
            result = self.call(Prefill(seq.seq_id, token_tensor(request.prompt_token_ids), request.params.prompt_logprobs))
            stats = result.stats()
            stats["call_seconds"] = time.perf_counter() - called   # the prefill call as worker 0's scheduler saw it
            stats["queued_seconds"] = queued
            self._observe(len(request.prompt_token_ids), 0, result)
            logits, prompt_logprobs = result.logits, result.prompt_logprobs
        seq.prompt_logits = logits
        self._emit(seq, logits, prefill=stats, keep_logits=request.return_logits, prompt_logprobs=prompt_logprobs)

    def _observe(self, new_tokens: int, context: int, result: PrefillResult) -> None:
        """A prefill or extend call's time, for the chunk sizer's cost model."""
        if self.sizer is not None:
            self.sizer.observe(new_tokens, context, result.prefill_seconds)

    def _chunked(self, request: Request) -> bool:
        """Is this prompt prefilled in chunks (chunked prefill on)? One longer than chunk_tokens
        (--max-num-batched-tokens) always; a shorter one too while others decode, when in one call it would
        hold their next token past the ITL target (the chunk sizer's first chunk is shorter than it). Not
        one that wants prompt logprobs (they come out of one whole prefill)."""
        if self.sizer is None or request.params.prompt_logprobs is not None:
            return False
        n = len(request.prompt_token_ids)
        return n > self.chunk_tokens or bool(self.running) and self.sizer.size(0, n, True, self.step_seconds) < n

    def _chunk_long(self, num_tokens: int) -> bool:
        """Is a prefill of num_tokens longer than one chunk (--max-num-batched-tokens)?"""
        return self.chunk_tokens is not None and num_tokens > self.chunk_tokens

    def _adopt_cached_prefix(self, seq: RunningSequence, ids: list[int], chunk: int | None) -> int:
        """The sequence starts from a copy of the longest cached prefix of ids (what it prefills; the rest in
        chunks of `chunk`, None: one call) -> its length (0: none)."""
        hit = self.prefix_cache.lookup(ids)
        if hit is None:
            return 0
        source, length = hit
        if not self._fits_beside(self.kv.adopt_pages(source, length, len(ids) - length, chunk), keep_entry=source):
            return 0                                     # the copy and its extension do not fit: a prefill, as admitted
        self.call(Adopt(source, seq.seq_id, length))
        return length

    def _prefill_chunk(self) -> None:
        """The next chunk of the prompt being prefilled, sized by the chunk sizer (engine/chunk_sizer.py);
        after the last, its first token."""
        job = self.prefilling
        remaining = len(job.tokens) - job.done
        busy = bool(self.running) or bool(self.waiting and self._short(self.waiting[0]))   # someone to serve soon
        n = self.sizer.size(job.done, remaining, busy, self.step_seconds) if self.sizer else remaining
        if not self._make_room_for_chunk(job, n):
            return
        if self._advance(job, n):
            self.prefilling = None

    def _chunk_with_decode(self) -> bool:
        """The long prompt's next chunk and a decode step of the running sequences in one forward pass
        (--mixed-batch: see mixed_batch_limit; Sarathi's mixed batch: the weights read once for both) -> False when it cannot
        be one (the first chunk is a prefill by the prompt's strategy; a chunk above the limit), and nothing was done."""
        job = self.prefilling
        if job.done == 0 or self.mixed_limit is not None and self._next_mixed_chunk(job) > self.mixed_limit:
            return False
        batch = self._make_room(list(self.running))      # may requeue the prompt (it gives way first)
        if self.prefilling is None or not batch:
            if batch:
                self._decode_batch(batch)
            return True
        n = self._next_mixed_chunk(job)
        step = self.ledger.step_new_pages([s.seq_id for s in batch])
        if not self._fits([c + d for c, d in zip(self.kv.chunk_pages(job.seq.seq_id, n, step), step)]):
            self._requeue_prefilling()                  # the running sequences took the pages: it gives way
            self._decode_batch(batch)
            return True
        if self._advance(job, n, decode=batch):
            self.prefilling = None
        return True

    def _next_mixed_chunk(self, job: ChunkedPrefill) -> int:
        """The size of the job's next chunk run with a decode step (the step is in the same call)."""
        remaining = len(job.tokens) - job.done
        return self.sizer.size(job.done, remaining, True, 0.0) if self.sizer else remaining

    def _decode_batch(self, batch: list[RunningSequence]) -> None:
        step = self._decode_call(batch)
        called = time.perf_counter()
        decoded = self.call(step)
        self.step_seconds = time.perf_counter() - called
        self._finish_decode(batch, step.host_rows, decoded)

    def _advance(self, job: ChunkedPrefill, n: int, decode: list[RunningSequence] | None = None) -> bool:
        """Prefills the job's next n prompt tokens: the first chunk as a prefill, the others as an
        incremental prefill over the tokens before them (with `decode`: and a decode step of those running
        sequences in the same call); after the last, samples its first token -> done?"""
        ids = job.tokens
        chunk = token_tensor(ids[job.done:job.done + n])
        called = time.perf_counter()
        if job.done == 0:                     # nothing cached: the first chunk is a prefill
            result = self.call(Prefill(job.seq.seq_id, chunk))
        elif decode is None:
            result = self.call(Extend(job.seq.seq_id, chunk, job.done))
        else:
            step = self._decode_call(decode)
            result = self.call(ExtendAndDecode(Extend(job.seq.seq_id, chunk, job.done), step))
            self._finish_decode(decode, step.host_rows, result.decode)   # before the prompt joins the running
        job.call_seconds += time.perf_counter() - called
        if log.isEnabledFor(logging.DEBUG) and self.sizer is not None and self.sizer.calls:
            log.debug("chunk of %d tokens after %d (%s): %.1f ms (predicted %.1f), last decode step %.1f ms", n,
                      job.done, result.extend_way or "prefill", result.prefill_seconds * 1e3,
                      self.sizer.predict(n, job.done) * 1e3, self.step_seconds * 1e3)
        self._observe(n, job.done, result)
        job.prefill_seconds += result.prefill_seconds
        job.done += n
        job.chunks += 1
        job.smallest, job.largest = min(job.smallest or n, n), max(job.largest, n)
        if result.extend_way is not None:
            job.extend_ways[result.extend_way] = job.extend_ways.get(result.extend_way, 0) + 1
        job.graphed += int(result.graphed)
        job.mixed += int(decode is not None)
        if job.done < len(ids):
            return False
        logits = result.logits
        if job.resumed:                       # its cache is whole again: it samples on, no first-token stats
            self._emit(job.seq, logits)
            return True
        stats = result.stats()
        stats.update(prefill_seconds=job.prefill_seconds, call_seconds=job.call_seconds, chunks=job.chunks,
                      cached_tokens=job.cached, smallest_chunk=job.smallest, largest_chunk=job.largest,
                      adopt_seconds=job.adopt_seconds, queued_seconds=job.queued_seconds,
                      extend_ways=dict(job.extend_ways), graphed_extends=job.graphed,
                      mixed_chunks=job.mixed)
        job.seq.prompt_logits = logits
        self._emit(job.seq, logits, prefill=stats, keep_logits=job.seq.request.return_logits)
        return True

    def _make_room_for_chunk(self, job: "ChunkedPrefill", n: int) -> bool:
        """Do the chunk's pages fit on every worker (prefix-cache entries evicted if needed)? If not, the
        running sequences took them since admission: the prompt, the newest request, gives way (its pages
        freed, back at the head of the queue: first come, first served) -> False."""
        if self._fits(self.kv.chunk_pages(job.seq.seq_id if job.done else None, n)):
            return True
        if not self.running:       # admission planned every chunk's pages on an otherwise empty cache
            raise RuntimeError(f"a prompt chunk of {n} tokens does not fit in an otherwise empty KV cache")
        self._requeue_prefilling()
        return False

    def _requeue_prefilling(self) -> None:
        job, self.prefilling = self.prefilling, None
        if job.resumed:                       # a preempted sequence's recompute: back among the preempted,
            self._preempt(job.seq, job.tokens[:job.done])    # what it recomputed so far kept as its entry
            return
        self._free([job.seq])
        self.waiting.appendleft(job.seq.request)
        self.num_preemptions += 1
        log.info("request %s preempted (KV cache full) after %d of its %d prompt tokens; it will be prefilled again",
                 job.seq.request.request_id, job.done, len(job.tokens))

    def _grammar(self, request: Request) -> SequenceGrammar | None:
        """A fresh matcher for a constrained request (each of n choices has its own); the grammar is
        compiled at the first request with this response_format, then taken from the cache."""
        if request.structured is None:
            return None
        source = request.structured.source
        backend = self.grammars.get(source)
        if backend is None:
            backend = self.grammars[source] = GrammarBackend(source)
        return backend.matcher(request.structured.spec)

    def _running_twin(self, request: Request) -> RunningSequence | None:
        """A running sequence with exactly this prompt (say the n choices of one request), if any; not
        for a request that wants prompt logprobs (they come out of a prefill)."""
        if request.params.prompt_logprobs is not None:
            return None
        ids = request.prompt_token_ids
        return next((s for s in self.running if not s.preemptions
                     and len(s.request.prompt_token_ids) == len(ids) and s.request.prompt_token_ids == ids), None)

    def _decode(self) -> None:
        batch = self._make_room(list(self.running))
        if not batch:
            return
        if self._pipelines(batch):
            self.inflight = self._launch(batch, None)   # read back by the next step's _decode_ahead, or _drain
        else:
            self._decode_batch(batch)

    def _pipelines(self, batch: list[RunningSequence]) -> bool:
        """May this batch's step be launched before the host reads the step before it (asynchronous
        scheduling)? Not with a grammar: the host masks its logits before its token is drawn."""
        return self.async_scheduling and all(s.grammar is None for s in batch)

    def _decodes_on(self) -> bool:
        """Is the next thing this loop does another decode step of the sequences running, nothing else
        (no abort, chunk, resume or admission)? Then the step in flight need not be read back first."""
        return bool(self.running) and not self.aborted and self.prefilling is None and not self.preempted and not (
            self.waiting and self._can_admit_request(self.waiting[0]))

    def _decode_ahead(self) -> None:
        """Asynchronous scheduling (vLLM's async scheduling; engine/step_tokens.py): the next step is launched
        while the one in flight runs, its input tokens taken on the device from the step in flight's, and
        only then is the step in flight read back, so the host's work between two steps (reading tokens,
        sending them out, scheduling, launching) no longer leaves the GPU idle. Its rows: the sequences
        still running, but not those whose token in flight surely ends them (max_tokens, max_model_len). One
        that ends by its token in flight (a stop token) still runs in the new step: that row's token is
        dropped, its K/V (the stop token's) kept with its cache. Pages that do not fit without preempting:
        nothing launched; the next step runs after the read-back, as without asynchronous scheduling."""
        prev, self.inflight = self.inflight, None
        running = {s.seq_id for s in self.running}
        batch = [s for s in prev.batch if s.seq_id in running and not self._last_token_in_flight(s)]
        if batch and self._pipelines(batch) and self._fits(self.ledger.step_new_pages([s.seq_id for s in batch])):
            rows = {s.seq_id: i for i, s in enumerate(prev.batch)}
            self.inflight = self._launch(batch, [rows[s.seq_id] for s in batch])
        self._collect(prev)

    def _last_token_in_flight(self, seq: RunningSequence) -> bool:
        """Does the token being computed for seq surely end it (its max_tokens, or max_model_len)?"""
        n = len(seq.generated) + 1
        return n >= seq.request.params.max_tokens or len(seq.request.prompt_token_ids) + n >= self.max_model_len

    def _launch(self, batch: list[RunningSequence], fed_from: list[int] | None) -> StepInFlight:
        """Launches a decode step without waiting for its tokens. fed_from: per row, the row of the step in
        flight whose token is its input (not yet on the host, not yet in seq.generated); None: the host's."""
        ahead = int(fed_from is not None)
        tokens = [0 if ahead else s.generated[-1] for s in batch]
        positions = [len(s.request.prompt_token_ids) + len(s.generated) - 1 + ahead for s in batch]
        sampling = [row_sampling(s.request.params, len(s.generated) + ahead) for s in batch]
        if all(r.greedy and r.logprobs is None for r in sampling):
            sampling = None                                                  # argmax only
        pending = self.call(DecodeAhead([s.seq_id for s in batch], tokens, positions, sampling, fed_from=fed_from))
        return StepInFlight(batch, pending, bool(ahead), time.perf_counter())

    def _drain(self) -> None:
        """Reads back the step in flight, if any (before anything but another decode step)."""
        if self.inflight is not None:
            prev, self.inflight = self.inflight, None
            self._collect(prev)

    def _collect(self, step: StepInFlight) -> None:
        """Waits for a launched step's tokens and commits them, as _finish_decode does. Its rows of sequences
        that ended at the step before (a stop token read back after this step was launched) are dropped; a
        sequence in the step now in flight (self.inflight) has that step computing its new token's K/V."""
        tokens, logprobs = step.pending.result()
        now = time.perf_counter()
        self.step_seconds = now - (self._collected_at if step.fed else step.launched)
        self._collected_at = now
        fed = {s.seq_id for s in self.inflight.batch} if self.inflight is not None else set()
        running = {s.seq_id for s in self.running}
        stepped = {s.seq_id for s in step.batch}
        self.running = [s for s in self.running if s.seq_id not in stepped]
        self._step_outputs = []
        for i, (seq, token) in enumerate(zip(step.batch, tokens)):
            if seq.seq_id in running:
                self._commit(seq, token, logprobs[i] if logprobs else None, token_computed=seq.seq_id in fed)
        outputs, self._step_outputs = self._step_outputs, None
        self.outputs.put(("outs", outputs))

    @staticmethod
    def _decode_call(batch: list[RunningSequence]) -> Decode:
        """The batch's decode step: seq ids, last tokens, their positions, sampling rules (None: argmax only),
        the rows sampled on the host."""
        tokens = [s.generated[-1] for s in batch]
        positions = [len(s.request.prompt_token_ids) + len(s.generated) - 1 for s in batch]
        host_rows = [i for i, s in enumerate(batch) if s.grammar is not None]   # masked on the host
        sampling = [s.sampling() for s in batch]
        if all(r.greedy and r.logprobs is None for r in sampling):
            sampling = None                                                # argmax only
        return Decode([s.seq_id for s in batch], tokens, positions, sampling, host_rows)

    def _finish_decode(self, batch: list[RunningSequence], host_rows: list[int], decoded: DecodeResult) -> None:
        """Commits a decode step's tokens (grammar rows sampled here from their masked logits)."""
        sampled, logits, logprobs = decoded.tokens, decoded.host_logits, decoded.logprobs
        masked = {}
        if host_rows:   # a masked copy of those rows, in one call; logprobs still read the model's logits
            rows = mask_logits(logits.clone(), [batch[i].grammar for i in host_rows])
            masked = {i: (logits[j], rows[j]) for j, i in enumerate(host_rows)}
        self.running = []
        self._step_outputs = []           # sent as one message: one pickle and queue put per step, not per token
        for i, seq in enumerate(batch):
            if i in masked:
                self._emit(seq, masked[i][0], sample_logits=masked[i][1])
            else:
                self._commit(seq, sampled[i], logprobs[i] if logprobs else None)
        outputs, self._step_outputs = self._step_outputs, None
        self.outputs.put(("outs", outputs))

    def _make_room(self, batch: list[RunningSequence]) -> list[RunningSequence]:
        """Preempts the newest sequences until this step's new pages fit on every worker; returns the rest."""
        while batch:
            if self._fits(self.ledger.step_new_pages([s.seq_id for s in batch])):
                return batch
            if self.prefilling is not None:   # the newest request: it gives way first
                self._requeue_prefilling()
                continue
            if len(batch) == 1:   # alone and out of pages: larger than the cache, which check_fits refuses
                raise RuntimeError(f"sequence {batch[0].seq_id} cannot grow in an otherwise empty KV cache")
            victim = max(batch, key=lambda s: (s.request.arrival_time, s.seq_id))
            batch.remove(victim)
            self.running.remove(victim)
            self._preempt(victim)
        return batch

    def _preempt(self, seq: RunningSequence, computed: list[int] | None = None) -> None:
        """Out of the batch; with the prefix cache its pages stay as an entry of the tokens whose K/V exist
        (`computed`; by default all but its last sampled token's), else (or with none) they are freed."""
        if computed is None:
            computed = seq.request.prompt_token_ids + seq.generated[:-1]
        if self.prefix_cache is not None and computed:
            self.call(Retire([seq.seq_id]))
            self.prefix_cache.insert(seq.seq_id, computed)
        else:
            self.call(Free([seq.seq_id]))
        seq.preemptions += 1
        self.num_preemptions += 1
        self.preempted.append(seq)
        self.preempted = deque(sorted(self.preempted, key=lambda s: (s.request.arrival_time, s.seq_id)))
        log.info("request %s preempted (KV cache full) after %d tokens; it will be recomputed",
                 seq.request.request_id, len(seq.generated))

    def _resume(self, seq: RunningSequence) -> None:
        """A preempted sequence decodes again: on its kept pages when its entry is still there, else after
        recomputing its cache (prompt + generated) as a prompt is prefilled: from the longest prefix the
        prefix cache holds, in chunks when longer than one (between them the others decode), then
        sampling its next token."""
        ids = seq.request.prompt_token_ids + seq.generated
        kept = self._kept(seq)
        if kept:                              # it takes back its entry's pages
            self.prefix_cache.remove(seq.seq_id)
            self.call(Reinstate([seq.seq_id]))
            if kept == len(ids) - 1:          # all of them: it decodes on
                self.running.append(seq)
                log.info("request %s resumed on its kept pages", seq.request.request_id)
                return
        cached = kept or (self._adopt_cached_prefix(seq, ids, self.chunk_tokens) if self.prefix_cache is not None else 0)
        self.recomputed_tokens += len(ids) - cached
        log.info("request %s resumed: %d tokens to recompute, %d of them found in the prefix cache",
                 seq.request.request_id, len(ids), cached)
        if cached or self._chunk_long(len(ids)):
            self.prefilling = ChunkedPrefill(seq, ids, done=cached, cached=cached)
            self._prefill_chunk()
            return
        result = self.call(Prefill(seq.seq_id, token_tensor(ids)))
        self._observe(len(ids), 0, result)
        self._emit(seq, result.logits)

    def _emit(self, seq: RunningSequence, logits: torch.Tensor, prefill: dict | None = None,
              keep_logits: bool = False, prompt_logprobs: list | None = None,
              sample_logits: torch.Tensor | None = None) -> None:
        """Samples from `sample_logits` (the grammar-masked logits) when given or when the sequence has
        a grammar, else from `logits`; the logprobs are always the model's own (unmasked) `logits`."""
        params = seq.request.params
        if sample_logits is None and seq.grammar is not None:
            sample_logits = mask_logits(logits.unsqueeze(0).clone(), [seq.grammar])[0]
        rule = seq.sampling()
        # on worker 0's device, as decode steps sample: a seeded request's noise is the same whichever draws it
        source = (logits if sample_logits is None else sample_logits).to(self.kv.device)
        token = sample_rows(source[None], [rule])
        logprobs = rows_logprobs(logits[None], token.cpu(), [params.logprobs])[0] if params.logprobs is not None else None
        token = int(token[0])
        self._commit(seq, token, logprobs, prefill=prefill, logits=logits.clone() if keep_logits else None,
                     prompt_logprobs=prompt_logprobs)

    def _commit(self, seq: RunningSequence, token: int, logprobs: dict | None, prefill: dict | None = None,
                logits: torch.Tensor | None = None, prompt_logprobs: list | None = None,
                token_computed: bool = False) -> None:
        """Sends one sampled token back; the sequence runs on or is freed (token_computed: a step in flight
        computes this token's K/V, kept with the cache when it ends)."""
        seq.generated.append(token)
        reason = self._finish_reason(seq, token)
        item = StepOutput(seq.request.request_id, token, logprobs, reason, time.time(), prefill=prefill,
                          logits=logits, prompt_logprobs=prompt_logprobs)
        if self._step_outputs is not None:
            self._step_outputs.append(item)
        else:
            self.outputs.put(("out", item))
        if reason is None:
            self.running.append(seq)
        elif self.prefix_cache is not None and reason != "abort":
            self.call(Retire([seq.seq_id]))
            computed = seq.generated if token_computed else seq.generated[:-1]                   # K/V computed
            self.prefix_cache.insert(seq.seq_id, seq.request.prompt_token_ids + computed)
        else:
            self._free([seq])

    def _free(self, seqs: list[RunningSequence]) -> None:
        self.call(Free([s.seq_id for s in seqs]))

    def _finish_reason(self, seq: RunningSequence, token: int) -> str | None:
        params = seq.request.params
        grammar_ended = False
        if seq.grammar is not None:
            if not seq.grammar.accept(token):   # cannot happen with a masked sample; never run on off-grammar
                log.error("request %s: token %d does not match its response_format; ending it",
                          seq.request.request_id, token)
                return "abort"
            grammar_ended = seq.grammar.terminated   # its stop token accepted: ends even with ignore_eos
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos) or grammar_ended:
            return "stop"
        if len(seq.generated) >= params.max_tokens:
            return "length"
        if len(seq.request.prompt_token_ids) + len(seq.generated) >= self.max_model_len:
            return "length"
        return None

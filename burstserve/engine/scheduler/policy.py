"""What the scheduler does next: one move per turn, computed without changing anything.

Policy.plan(state) reads the scheduler's state (engine/scheduler/sequences.py) and the KV manager's queries
(engine/cache/kv_manager.py) and answers with one of the moves below; Scheduler.schedule makes it the turn's
StepPlan (engine/scheduler/step.py), asking nothing more. A move is complete: what runs, how (a request's start: a copy of a running twin, of a cached
prefix, or a prefill; whole or in chunks), and which prefix-cache entries to evict for its pages.

The rules, in order:
1. A decode step in flight (asynchronous scheduling) is followed by the next decode step, launched before
   it is read back, only when that is all that would run next; otherwise it is read back first.
2. After a prompt or a chunk of one ran, the running sequences take a decode step.
3. While the prompt being prefilled in chunks waits for its cached prefix to come back from the host tier,
   the running sequences decode (with none running, its chunk runs at once, each layer waiting for its
   copy). Then, a short waiting request (one chunk's worth) that fits beside
   the pages the long one still needs goes first, every other turn; otherwise the next chunk runs (with the
   running sequences' decode step in the same call when that is one CUDA graph, or asked for).
4. Otherwise, preempted sequences resume before any new request is admitted; requests are admitted first
   come, first served (a batch slot and their pages, leaving a watermark free while others run), each
   started the cheapest way whose pages fit: a copy of a running twin's prompt, of the longest cached
   prefix, else a prefill. A prompt in chunks runs its first chunk in the next turn.
5. Otherwise the running sequences decode. A decode step whose new pages do not fit makes room: the prompt
   being prefilled gives way first (back to the head of the queue), then the newest running sequence is
   preempted.
"""
from dataclasses import dataclass, field

from burstserve.engine.cache.kv_manager import Eviction, Hit, KVManager
from burstserve.engine.core.outputs import Request
from burstserve.engine.scheduler.chunk_sizer import ChunkSizer
from burstserve.engine.scheduler.sequences import ChunkedPrefill, RunningSequence, SchedulerState


def mixed_batch_limit(engine, graph_tokens: int) -> int | None:
    """The largest chunk that runs with a decode step in one forward pass: --mixed-batch as asked (any chunk: None;
    0 with --no-mixed-batch), or by default the chunks the workers replay with a decode step as one CUDA graph
    (`graph_tokens`: engine/runner/extend_graphs.py ExtendGraphs.mixed_max_tokens, 0 where none): one graph of a late chunk
    and the decode step beats the two graphs apart, while an eager mixed pass is bound by the host and slower than both
    (docs/benchmarks.md, Chunked prefill and interference)."""
    if engine.mixed_batch is not None:
        return None if engine.mixed_batch else 0
    return graph_tokens


@dataclass(frozen=True)
class CopyTwin:
    """The request starts as a copy of a running sequence's prompt K/V (the same prompt: one request's n
    choices), its first token sampled from the twin's prompt logits."""
    twin: RunningSequence


@dataclass(frozen=True)
class FromPrefix:
    """The request starts as a copy of a cached prefix (in the pool, or restored from the host tier); the rest
    is prefilled in chunks from the next turn on, or at once in one call beside a long prompt's chunks."""
    hit: Hit


@dataclass(frozen=True)
class Admit:
    """Admit a waiting request (the head of the queue): as `start` says, else prefilled, in one call now or
    (`chunked`) in chunks from the next turn on; beside a long prompt's chunks always in one call now."""
    request: Request
    chunked: bool                 # its prefill is chunked (engine/step_plan.Policy.chunked)
    evict: list[Eviction] = field(default_factory=list)
    start: "CopyTwin | FromPrefix | None" = None


@dataclass(frozen=True)
class TakeBack:
    """A preempted sequence takes its prefix-cache entry's pages back (what is left of them)."""


@dataclass(frozen=True)
class Resume:
    """A preempted sequence (the oldest) decodes again: on its kept pages (`start` TakeBack; the tail it lost,
    if any, recomputed in chunks from the next turn), or after recomputing its cache (prompt + generated) as
    a prompt is prefilled: from a copy of a cached prefix (its own entry dropped first) or from nothing, in
    one call now or (`chunked`, or from a prefix) in chunks from the next turn."""
    seq: RunningSequence
    evict: list[Eviction] = field(default_factory=list)
    start: "TakeBack | FromPrefix | None" = None
    chunked: bool = False


@dataclass(frozen=True)
class PrefillChunk:
    """The next `tokens` of the prompt being prefilled in chunks (with `decode`: and a decode step of those
    sequences in the same call)."""
    tokens: int
    decode: list[RunningSequence] | None = None
    evict: list[Eviction] = field(default_factory=list)


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of the running sequences (`ahead`: launched, read back by the next turn)."""
    batch: list[RunningSequence]
    evict: list[Eviction] = field(default_factory=list)
    ahead: bool = False


@dataclass(frozen=True)
class StepAhead:
    """Launch the next decode step of `batch` (rows: each one's row in the step in flight, whose token is
    its input), then read back the step in flight; batch empty: only the read-back."""
    batch: list[RunningSequence]
    rows: list[int]
    evict: list[Eviction] = field(default_factory=list)


@dataclass(frozen=True)
class ReadBack:
    """Wait for the step in flight's tokens (before anything but another decode step)."""


@dataclass(frozen=True)
class Preempt:
    """The newest running sequence leaves the batch: a decode step has no pages for it."""
    seq: RunningSequence


@dataclass(frozen=True)
class GiveWay:
    """The prompt being prefilled in chunks gives its pages back and waits again (the running sequences took
    the pages its next chunk needs)."""


@dataclass(frozen=True)
class Stuck:
    """Nothing runs and the first waiting sequence does not fit in the empty cache (a bug: refused earlier)."""
    why: str


@dataclass(frozen=True)
class Idle:
    """Nothing to do."""


class Policy:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_model_len: int, chunk_tokens: int | None,
                 sizer: ChunkSizer | None, mixed_limit: int | None, async_scheduling: bool):
        """chunk_tokens: the longest chunk (None: no chunked prefill); mixed_limit: the largest chunk run with
        a decode step in one call (None: any; 0: none)."""
        self.kv, self.max_num_seqs, self.max_model_len = kv, max_num_seqs, max_model_len
        self.chunk_tokens, self.sizer = chunk_tokens, sizer
        self.mixed_limit, self.async_scheduling = mixed_limit, async_scheduling

    def plan(self, s: SchedulerState):
        """The next turn (one of this module's plans)."""
        if s.inflight is not None:
            return self._decode_ahead(s) if self._decodes_on(s) else ReadBack()
        if s.decode_owed and s.running:
            return self._decode(s)
        if s.prefilling is not None:
            if s.running and self._restoring(s):
                return self._decode(s)
            short = None if s.short_went_first else self._short_beside(s)
            return short or self.next_chunk(s)
        if s.preempted:
            resume = self._resume(s, s.preempted[0])
            if resume is not None:
                return resume
        elif s.waiting:
            admit = self._admit(s, s.waiting[0])
            if admit is not None:
                return admit
        if s.running:
            return self._decode(s)
        return self._stuck(s) if s.preempted or s.waiting else Idle()

    def _stuck(self, s: SchedulerState) -> Stuck:
        """LLM.submit refuses any request larger than an empty cache (check_fits): said loudly, not a silent hang."""
        tokens = s.preempted[0].tokens_to_recompute() if s.preempted else len(s.waiting[0].prompt_token_ids)
        return Stuck(f"a sequence of {tokens} tokens does not fit in the empty KV cache ({self.kv.free_pages()} "
                     f"free pages per worker); LLM.check_fits should have refused it")

    # rule 1

    def _decodes_on(self, s: SchedulerState) -> bool:
        """Is the next thing to do another decode step of the sequences running, nothing else (no abort,
        chunk, resume or admission)? Then the step in flight need not be read back first."""
        return bool(s.running) and not s.aborted and (s.prefilling is None or self._restoring(s)) and \
            not s.preempted and not (s.prefilling is None and s.waiting and self._admit(s, s.waiting[0]) is not None)

    def _restoring(self, s: SchedulerState) -> bool:
        """Is the prompt being prefilled in chunks waiting for its restore from the host tier?"""
        return s.prefilling is not None and self.kv.copies.restoring(s.prefilling.seq.seq_id)

    def _decode_ahead(self, s: SchedulerState) -> StepAhead:
        """The step in flight's rows that decode on: still running, and not ended for sure by the token in
        flight (max_tokens, max_model_len). A row ended by its token in flight (a stop token) still runs: its
        token is dropped, its K/V kept with its cache. Their pages must fit without preempting."""
        prev = s.inflight
        running = {x.seq_id for x in s.running}
        batch = [x for x in prev.batch if x.seq_id in running and not self._last_token_in_flight(x)]
        if batch and self.pipelines(batch):
            evict = self._room(s, self.kv.step_pages([x.seq_id for x in batch]))
            if evict is not None:
                rows = {x.seq_id: i for i, x in enumerate(prev.batch)}
                return StepAhead(batch, [rows[x.seq_id] for x in batch], evict)
        return StepAhead([], [])

    def pipelines(self, batch: list[RunningSequence]) -> bool:
        """May this batch's step be launched before the host reads the step before it (asynchronous
        scheduling)? Not with a grammar: the host masks its logits before its token is drawn."""
        return self.async_scheduling and all(x.grammar is None for x in batch)

    def _last_token_in_flight(self, seq: RunningSequence) -> bool:
        """Does the token being computed for seq surely end it (its max_tokens, or max_model_len)?"""
        return seq.ends_by_length(len(seq.generated) + 1, self.max_model_len)

    # rules 2 and 5

    def _decode(self, s: SchedulerState):
        """A step of every running sequence if its new pages fit; else the prompt in chunks gives way, else
        the newest sequence is preempted."""
        evict = self._room(s, self.kv.step_pages([x.seq_id for x in s.running]))
        if evict is not None:
            return DecodeStep(list(s.running), evict, self.pipelines(s.running))
        if s.prefilling is not None:
            return GiveWay()
        if len(s.running) == 1:   # alone and out of pages: larger than the cache, which check_fits refuses
            raise RuntimeError(f"sequence {s.running[0].seq_id} cannot grow in an otherwise empty KV cache")
        return Preempt(max(s.running, key=lambda x: (x.request.arrival_time, x.seq_id)))

    # rule 3

    def _short_beside(self, s: SchedulerState) -> Admit | None:
        """The first waiting request, when it is one chunk's worth (not chunked itself) and fits beside the
        pages the long prompt's remaining chunks will take: a short request is not stuck behind a long one."""
        if s.preempted or not s.waiting or len(s.running) >= self.max_num_seqs:
            return None
        request = s.waiting[0]
        return self._admit(s, request) if self.short(request) else None

    def short(self, request: Request) -> bool:
        """At most one chunk's worth of tokens (a prompt-logprobs request, never chunked, may be longer)."""
        return self.chunk_tokens is not None and len(request.prompt_token_ids) <= self.chunk_tokens

    def _prefilling_reserve(self, s: SchedulerState) -> list[int]:
        """Pages per worker the prompt being prefilled in chunks still takes (zeros when none): what a request
        admitted beside it must leave free. One page more than planned: its chunks' sizes adapt."""
        job = s.prefilling
        if job is None:
            return [0] * self.kv.ledger.world_size
        pages = (self.kv.pages.growth_pages(job.seq.seq_id, job.remaining, self.chunk_tokens) if job.done else
                 self.kv.pages.chunked_prefill_pages(job.remaining, self.chunk_tokens))    # not started yet
        return [max(0, n + 1) for n in pages]

    def next_chunk(self, s: SchedulerState):
        """The next chunk, with the running sequences' decode step when the chunk is small enough; GiveWay when
        its pages no longer fit beside the running sequences."""
        job = s.prefilling
        if self.mixed_limit != 0 and s.running and job.done > 0:
            n = self._next_mixed_chunk(job)
            if self.mixed_limit is None or n <= self.mixed_limit:
                step = self.kv.step_pages([x.seq_id for x in s.running])
                need = [c + d for c, d in zip(self.kv.pages.chunk_pages(job.seq.seq_id, n, step), step)]
                evict = self._room(s, need)
                return GiveWay() if evict is None else PrefillChunk(n, list(s.running), evict)
        busy = bool(s.running) or bool(s.waiting and self.short(s.waiting[0]))   # someone to serve soon
        n = self.sizer.size(job.done, job.remaining, busy, s.step_seconds) if self.sizer else job.remaining
        evict = self._room(s, self.kv.pages.chunk_pages(job.seq.seq_id if job.done else None, n))
        if evict is not None:
            return PrefillChunk(n, None, evict)
        if not s.running:       # admission planned every chunk's pages on an otherwise empty cache
            raise RuntimeError(f"a prompt chunk of {n} tokens does not fit in an otherwise empty KV cache")
        return GiveWay()

    def _next_mixed_chunk(self, job: ChunkedPrefill) -> int:
        """The size of the job's next chunk run with a decode step (the step is in the same call)."""
        return self.sizer.size(job.done, job.remaining, True, 0.0) if self.sizer else job.remaining

    # rule 4

    def _resume(self, s: SchedulerState, seq: RunningSequence) -> Resume | None:
        """A batch slot and the watermark, then: its entry taken back (the pages its next step takes when it
        kept everything, else its recomputed tail's), unless the host tier holds enough more of it; else, its
        entry dropped first, a copy of the longest cached prefix and the rest, or a recompute from nothing
        (chunked when longer than a chunk)."""
        if len(s.running) >= self.max_num_seqs:
            return None
        ids = seq.recompute_ids()
        n, kept, keep = len(ids), self.kv.kept(seq.seq_id), self._keep(s)
        host = self.kv.host_hit(ids, kept) if kept < n - 1 else None
        if kept and host is None:
            need = (self.kv.step_pages([seq.seq_id]) if kept == n - 1   # whole: else its next step preempts it
                    else self.kv.pages.growth_pages(seq.seq_id, n - kept, self.chunk_tokens))
            evict = self._room(s, self._plus(need, keep), keep_entry=seq.seq_id)
            return None if evict is None else Resume(seq, evict, TakeBack())
        drop = [seq.seq_id] if kept else []            # its own entry goes first: a longer copy replaces it
        found = self._prefix_that_fits(s, ids, keep, first=drop, skip=seq.seq_id)
        if found is not None:
            return Resume(seq, found[1], FromPrefix(found[0]))
        chunked = self.chunk_long(n)
        evict = self._room(s, self._plus(self._prefill_pages(n, chunked), keep), prompt=ids, first=drop)
        return None if evict is None else Resume(seq, evict, None, chunked)

    def _admit(self, s: SchedulerState, request: Request) -> Admit | None:
        """A batch slot, then the first way whose pages fit (with the watermark, and beside a long prompt its
        remaining chunks' pages): a copy of a running twin's prompt, a copy of the longest cached prefix (its
        entry kept whole) and the rest, a prefill."""
        if len(s.running) >= self.max_num_seqs:
            return None
        ids = request.prompt_token_ids
        keep, reserve = self._keep(s), self._prefilling_reserve(s)
        twin = s.running_twin(request)
        if twin is not None:
            evict = self._room(s, self._plus(self.kv.pages.fork_pages(twin.seq_id), keep, reserve))
            if evict is not None:
                return Admit(request, False, evict, CopyTwin(twin))
        found = None
        if request.params.prompt_logprobs is None:      # prompt logprobs come out of a whole prefill
            found = self._prefix_that_fits(s, ids, keep, reserve, prompt=ids)
        if found is not None:
            return Admit(request, True, found[1], FromPrefix(found[0]))
        chunked = self.chunked(s, request)
        evict = self._room(s, self._plus(self._prefill_pages(len(ids), chunked), keep, reserve), prompt=ids)
        return None if evict is None else Admit(request, chunked, evict)

    def _prefix_that_fits(self, s: SchedulerState, ids: list[int], keep: int, reserve: list[int] | None = None,
                          prompt: list[int] | None = None, first: list[int] = (),
                          skip: int | None = None) -> "tuple[Hit, list[Eviction]] | None":
        """The best cached prefix of `ids` (kv.prefixes, `skip` not copied) whose copy and the rest's pages fit,
        its own pool entry kept whole -> (it, the evictions that make room), or None."""
        for hit in self.kv.prefixes(ids, skip=skip):
            need = self.kv.hit_pages(hit, len(ids) - hit.length, self.chunk_tokens)
            evict = self._room(s, self._plus(need, keep, reserve), None if hit.on_host else hit.entry, prompt, first)
            if evict is not None:
                return hit, evict
        return None

    def _prefill_pages(self, n: int, chunked: bool) -> list[int]:
        """The pages of n tokens prefilled in one call or in chunks (as its chunks place them). Planned with
        chunks of chunk_tokens; adapted sizes end as level (every worker within one token of N / workers), so
        on a cache with no running sequences the plan's largest share always fits."""
        return (self.kv.pages.chunked_prefill_pages(n, self.chunk_tokens) if chunked
                else self.kv.pages.prefill_pages(n))

    def chunked(self, s: SchedulerState, request: Request) -> bool:
        """Is this prompt prefilled in chunks (chunked prefill on)? One longer than chunk_tokens
        (--max-num-batched-tokens) always; a shorter one too while others decode, when in one call it would
        hold their next token past the ITL target (the chunk sizer's first chunk is shorter than it). Not
        one that wants prompt logprobs (they come out of one whole prefill)."""
        if self.sizer is None or request.params.prompt_logprobs is not None:
            return False
        n = len(request.prompt_token_ids)
        return n > self.chunk_tokens or bool(s.running) and self.sizer.size(0, n, True, s.step_seconds) < n

    def chunk_long(self, num_tokens: int) -> bool:
        """Is a prefill of num_tokens longer than one chunk (--max-num-batched-tokens)?"""
        return self.chunk_tokens is not None and num_tokens > self.chunk_tokens

    # pages

    def _keep(self, s: SchedulerState) -> int:
        """Pages a new sequence leaves free for the running ones to grow."""
        return self.kv.watermark if s.running else 0

    @staticmethod
    def _plus(need: list[int], keep: int, reserve: list[int] | None = None) -> list[int]:
        return [n + keep + (reserve[r] if reserve else 0) for r, n in enumerate(need)]

    def _room(self, s: SchedulerState, need: list[int], keep_entry: int | None = None,
              prompt: list[int] | None = None, first: list[int] = ()) -> "list[Eviction] | None":
        """kv.room_for, preempted sequences' entries evicted last (the next to resume last of all), but
        `first`."""
        last = [x.seq_id for x in reversed(s.preempted) if x.seq_id not in first]
        return self.kv.room_for(need, keep_entry, prompt, last=last, first=first)

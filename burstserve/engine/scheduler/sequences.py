"""What worker 0's scheduler keeps about its requests: the sequences running, the prompt being prefilled
in chunks, the decode step in flight, and the queues, as one SchedulerState that the policy reads
(engine/scheduler/policy.py) and only the scheduler changes (engine/scheduler/scheduler.py, and its
decode_steps.py and prompt_results.py)."""
import array
import dataclasses
from collections import deque
from dataclasses import dataclass, field

import torch

from burstserve.engine.core.calls import PrefillResult
from burstserve.engine.core.outputs import PrefillStats, Request
from burstserve.engine.core.sampling import RowSampling, row_sampling
from burstserve.engine.core.structured_output import SequenceGrammar


def token_tensor(ids: list[int]) -> torch.Tensor:
    """[n] int64 of a list of token ids, through an array (a third of torch.tensor's time on a long prompt)."""
    return torch.frombuffer(array.array("q", ids), dtype=torch.int64) if ids else torch.empty(0, dtype=torch.int64)


@dataclass
class RunningSequence:
    request: Request
    seq_id: int
    generated: list[int] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None    # [V] fp32, the prefill's where kept: a twin's first token samples from it
    grammar: SequenceGrammar | None = None       # response_format: masks what this sequence may sample
    preemptions: int = 0                         # times preempted (its cache now starts with prompt + generated)
    _recompute: tuple | None = field(default=None, repr=False, compare=False)   # (generated count, its tokens)

    def sampling(self) -> RowSampling:
        """How its next token is sampled (seeded requests: the same noise for the same token index)."""
        return row_sampling(self.request.params, len(self.generated))

    def next_input_position(self) -> int:
        """The position of its last token, the next decode step's input."""
        return len(self.request.prompt_token_ids) + len(self.generated) - 1

    def ends_by_length(self, generated: int, max_model_len: int) -> bool:
        """Does it end once it has `generated` tokens: its max_tokens, or the model's length reached?"""
        prompt = len(self.request.prompt_token_ids)
        return generated >= self.request.params.max_tokens or prompt + generated >= max_model_len

    def tokens_to_recompute(self) -> int:
        """Its prompt and generated tokens: what a recompute after preemption prefills."""
        return len(self.request.prompt_token_ids) + len(self.generated)

    def recompute_ids(self) -> list[int]:
        """Those tokens, one list while they do not change: a preempted sequence is planned every turn until it
        resumes, and the prefix cache hashes a list it was asked about last only once (KVManager._chain)."""
        if self._recompute is None or self._recompute[0] != len(self.generated):
            self._recompute = (len(self.generated), self.request.prompt_token_ids + self.generated)
        return self._recompute[1]


@dataclass
class ChunkedPrefill:
    seq: RunningSequence
    tokens: list[int]             # what it prefills: the prompt, or a preempted sequence's prompt + generated
    done: int = 0                 # of those, already in the KV cache
    cached: int = 0               # of those, taken from the prefix cache (the first chunk extends them)
    host_cached: int = 0          # of those, restored from the host tier (engine/pages/host_pool.py)
    restore_seconds: float | None = None   # that restore's copy (worker 0's)
    chunks: int = 0
    prefill_seconds: float = 0.0  # the workers' time over all chunks
    call_seconds: float = 0.0
    smallest: int = 0             # its smallest and largest chunk, in tokens
    largest: int = 0
    adopt_seconds: float = 0.0    # finding the cached prefix and copying it (worker 0's view)
    queued_seconds: float = 0.0   # from its arrival to this scheduler taking it up
    extend_ways: dict = field(default_factory=dict)   # incremental prefills by way (ExtendWay)
    graphed: int = 0              # of them, replayed as CUDA graphs (engine/runner/extend_graphs.py)
    mixed: int = 0                # of them, with the running sequences' decode step in the same call

    @property
    def resumed(self) -> bool:
        """Recomputing a preempted sequence (its next token continues its output; no first-token stats)."""
        return bool(self.seq.generated)

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done

    def count(self, n: int, result: PrefillResult, mixed: bool) -> None:
        """Its next n tokens prefilled by one call (its result; mixed: with a decode step in the same call)."""
        self.prefill_seconds += result.prefill_seconds
        if result.restore_seconds is not None:
            self.restore_seconds = result.restore_seconds
        self.done += n
        self.chunks += 1
        self.smallest, self.largest = min(self.smallest or n, n), max(self.largest, n)
        if result.extend_way is not None:
            way = str(result.extend_way)                               # the figures name it
            self.extend_ways[way] = self.extend_ways.get(way, 0) + 1
        self.graphed += int(result.graphed)
        self.mixed += int(mixed)

    def prompt_stats(self, last: PrefillResult) -> PrefillStats:
        """What the prompt reports as its prefill (a request's prefill_stats), after its last chunk's call."""
        stats = dataclasses.replace(
            last.stats(), prefill_seconds=self.prefill_seconds, call_seconds=self.call_seconds, chunks=self.chunks,
            cached_tokens=self.cached, host_cached_tokens=self.host_cached, smallest_chunk=self.smallest,
            largest_chunk=self.largest, adopt_seconds=self.adopt_seconds, queued_seconds=self.queued_seconds,
            extend_ways=dict(self.extend_ways), graphed_extends=self.graphed, mixed_chunks=self.mixed)
        if self.restore_seconds is not None:
            stats.restore_seconds = self.restore_seconds
        return stats


@dataclass
class StepInFlight:
    """A decode step launched and not yet read back (asynchronous scheduling: see engine/scheduler/decode_steps.py)."""
    batch: list[RunningSequence]
    pending: object               # worker 0's engine.step_tokens.PendingTokens
    fed: bool                     # its input tokens were the step before it's, on the device
    launched: float               # time.perf_counter() at its launch


@dataclass
class SchedulerState:
    waiting: deque = field(default_factory=deque)      # Requests not yet admitted, first come first served
    preempted: deque = field(default_factory=deque)    # RunningSequences to recompute, oldest first
    running: list = field(default_factory=list)        # RunningSequences decoding
    prefilling: ChunkedPrefill | None = None           # the prompt being prefilled chunk by chunk
    inflight: StepInFlight | None = None                # a decode step launched, its tokens not yet read
    aborted: set = field(default_factory=set)           # request ids to drop
    decode_owed: bool = False                           # a prompt or chunk ran: the running sequences step next
    short_went_first: bool = False                      # the last turn went to a short prompt, not a chunk
    step_seconds: float = 0.0                           # the last decode step, as the scheduler saw it

    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.preempted or self.prefilling or self.inflight)

    def running_twin(self, request: Request) -> "RunningSequence | None":
        """A running sequence with exactly this prompt (say the n choices of one request) whose prompt logits were
        kept, if any; not for a request that wants prompt logprobs (they come out of a prefill)."""
        if request.params.prompt_logprobs is not None:
            return None
        ids = request.prompt_token_ids
        return next((s for s in self.running if not s.preemptions and s.prompt_logits is not None
                     and len(s.request.prompt_token_ids) == len(ids) and s.request.prompt_token_ids == ids), None)

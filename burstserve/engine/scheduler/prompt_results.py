"""A prompt's call applied, as the scheduler's `update` applies a turn's results (engine/scheduler/scheduler.py):
its time for the chunk sizer's cost model, a chunk counted, and once the prompt is whole its next token committed
(a request's first, with its figures; a resumed sequence's next, without): drawn on worker 0's device by the call
(engine/core/calls.py SampleNext), or for a grammar's row drawn here from the masked logits; a copy of a running
twin's prompt draws from the twin's prompt logits."""
import logging
import time
from typing import Callable

from burstserve.engine.core.calls import PrefillResult
from burstserve.engine.core.outputs import PrefillStats
from burstserve.engine.scheduler.chunk_sizer import ChunkSizer
from burstserve.engine.scheduler.sequences import SchedulerState
from burstserve.engine.scheduler.step import PromptWork

log = logging.getLogger(__name__)


class PromptResults:
    def __init__(self, state: SchedulerState, sizer: ChunkSizer | None, commit: Callable, emit: Callable):
        """commit(seq, token, logprobs, prefill=..., logits=..., prompt_logprobs=...): the scheduler's, a token into
        its sequence; emit(seq, logits, prefill=..., keep_logits=..., prompt_logprobs=...): one drawn here first."""
        self.state, self.sizer, self.commit, self.emit = state, sizer, commit, emit

    def apply(self, work: PromptWork, result: PrefillResult | None, called: float, mixed: bool) -> None:
        """A prompt's call applied: timings for the chunk sizer, a chunk counted, and once the prompt is whole
        its next token sampled (a request's first, with its figures; a resumed sequence's next, without)."""
        seq, job = work.seq, work.job
        if work.twin_logits is not None:            # a copy of a running twin's prompt: no call ran
            seq.prompt_logits = work.twin_logits
            self.emit(seq, work.twin_logits, prefill=PrefillStats(prefill_seconds=0.0, shared_prefill=True),
                       keep_logits=seq.request.return_logits)
            return
        seconds = time.perf_counter() - called
        self._log_chunk(work, result)
        self._observe(work.new_tokens, work.context, result)
        if job is not None:
            job.call_seconds += seconds
            job.count(work.new_tokens, result, mixed=mixed)
            if job.done < len(job.tokens):
                return
            if self.state.prefilling is job:
                self.state.prefilling = None
        if work.resumed or (job is not None and job.resumed):   # its cache is whole again: it samples on
            self._next_token(seq, result)
            return
        seq.prompt_logits = result.logits                        # where kept: for a twin
        if job is not None:
            stats = job.prompt_stats(result)
        else:
            stats = result.stats()
            stats.call_seconds = seconds           # the prefill call as worker 0's scheduler saw it
            stats.queued_seconds = work.queued
        self._next_token(seq, result, prefill=stats, prompt_logprobs=result.prompt_logprobs if job is None else None)

    def _next_token(self, seq, result: PrefillResult, **figures) -> None:
        """The token after the prompt committed: the one drawn on worker 0's device, or a grammar's drawn here."""
        keep = seq.request.return_logits and "prefill" in figures           # a request's first token only
        if result.token is None:
            self.emit(seq, result.logits, keep_logits=keep, **figures)
        else:
            self.commit(seq, result.token, result.logprobs, logits=result.logits if keep else None, **figures)

    def _log_chunk(self, work: PromptWork, result: PrefillResult) -> None:
        if work.job is not None and log.isEnabledFor(logging.DEBUG) and self.sizer is not None and self.sizer.calls:
            log.debug("chunk of %d tokens after %d (%s): %.1f ms (predicted %.1f), last decode step %.1f ms",
                      work.new_tokens, work.context, result.extend_way or "prefill", result.prefill_seconds * 1e3,
                      self.sizer.predict(work.new_tokens, work.context) * 1e3, self.state.step_seconds * 1e3)

    def _observe(self, new_tokens: int, context: int, result: PrefillResult) -> None:
        """A prefill or extend call's time, for the chunk sizer's cost model."""
        if self.sizer is not None:
            self.sizer.observe(new_tokens, context, result.prefill_seconds)

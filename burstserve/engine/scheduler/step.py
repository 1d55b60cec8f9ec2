"""One turn of worker 0's scheduler as two values (engine/scheduler/scheduler.py): the StepPlan that `schedule`
makes (what the workers run, its pages taken in the KV manager's ledger, and what each result is for) and the
StepResult that `execute` returns: the only input of `update`, the one place results change the scheduler's state
(tokens committed, sequences ended, chunks counted, the host tier's progress)."""
from dataclasses import dataclass

import torch

from burstserve.engine.core.calls import DecodeResult, PrefillResult
from burstserve.engine.core.messages import HostProgress
from burstserve.engine.scheduler.sequences import ChunkedPrefill, RunningSequence, StepInFlight


@dataclass
class PromptWork:
    """The prompt a prefill or an extend runs for (or a copy of a twin's prompt, no call)."""
    seq: RunningSequence
    new_tokens: int                          # the call's tokens
    context: int                             # the sequence's tokens before them, already cached
    job: ChunkedPrefill | None = None        # the chunked prefill it is a chunk of (None: the prompt in one call)
    resumed: bool = False                    # a preempted sequence's cache recomputed: it samples on, no figures
    queued: float = 0.0                      # seconds the request waited (a prompt in one call: its figures)
    twin_logits: torch.Tensor | None = None  # a copy of a running twin's prompt: its prompt logits [V]


@dataclass
class StepPlan:
    """What one turn runs. `work` is the call every worker runs (a Prefill, an Extend, an ExtendAndDecode, a
    Decode or a DecodeAhead), placed by the KV manager while planning: its new tokens' workers and pages are
    taken in the ledger already. The cache's changes planning made (evictions, copies of a prefix or a twin, a
    preempted sequence's pages taken back or freed) went to worker 0's pool as they were made and go to the
    other workers before `work` (engine/scheduler/dispatch.py). No work: nothing to call (an admission in
    chunks from the next turn, a preemption, a read-back alone, idle)."""
    work: object | None = None
    prompt: PromptWork | None = None               # the prompt `work` runs (a copy of a twin's: no work)
    decode: list[RunningSequence] | None = None    # the batch of a decode step read back at once (alone or mixed)
    launch: list[RunningSequence] | None = None    # the batch of a decode step launched ahead (work: DecodeAhead)
    read_back: StepInFlight | None = None          # the step in flight before, read back after `work` is launched


@dataclass
class StepResult:
    """What `execute` returns for a StepPlan: the work's result on worker 0 and its time as the scheduler saw it,
    and the host tier's progress after it."""
    plan: StepPlan
    result: "PrefillResult | DecodeResult | object | None" = None   # object: a launched step's pending tokens
    called: float = 0.0                      # time.perf_counter() when the work was called
    seconds: float = 0.0                     # the call's time, as the scheduler saw it
    host: HostProgress | None = None         # worker 0's host tier after the turn (None: no tier)

    @property
    def prefill(self) -> PrefillResult | None:
        """The prompt's call's result (a prefill, an extend, a mixed call's chunk)."""
        return self.result if isinstance(self.result, PrefillResult) else None

    @property
    def decoded(self) -> DecodeResult | None:
        """A decode step's result read back at once (alone, or in a mixed call beside a chunk)."""
        if isinstance(self.result, DecodeResult):
            return self.result
        return self.result.decode if isinstance(self.result, PrefillResult) else None

"""What one turn's work returned, with what it was for: the only input of Scheduler.update (engine/scheduler/scheduler.py),
the one place results change the scheduler's state (tokens committed, sequences ended, chunks counted)."""
from dataclasses import dataclass

import torch

from burstserve.engine.core.calls import DecodeResult, PrefillResult
from burstserve.engine.scheduler.sequences import ChunkedPrefill, RunningSequence, StepInFlight


@dataclass
class PromptWork:
    """The prompt a prefill or an extend ran for (or a copy of a twin's prompt, no call)."""
    seq: RunningSequence
    new_tokens: int                          # the call's tokens
    context: int                             # the sequence's tokens before them, already cached
    job: ChunkedPrefill | None = None        # the chunked prefill it is a chunk of (None: the prompt in one call)
    resumed: bool = False                    # a preempted sequence's cache recomputed: it samples on, no figures
    queued: float = 0.0                      # seconds the request waited (a prompt in one call: its figures)
    called: float = 0.0                      # time.perf_counter() when the call was made
    twin_logits: torch.Tensor | None = None  # a copy of a running twin's prompt: its prompt logits [V]


@dataclass
class DecodeWork:
    """A decode step called and read back at once (alone, or in a mixed call beside a chunk)."""
    batch: list[RunningSequence]
    host_rows: list[int]                     # rows sampled on the host (grammars)
    result: DecodeResult


@dataclass
class StepResult:
    prompt: PromptWork | None = None
    prefill: PrefillResult | None = None     # the prompt's call's (None: a copy of a twin's prompt)
    decode: DecodeWork | None = None
    read_back: StepInFlight | None = None    # a step launched ahead, to be read back now

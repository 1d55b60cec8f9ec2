"""Results in the shape vLLM users know, and the per-token message workers send back."""
import array
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable, Iterable

import torch

from burstserve.engine.core.sampling import SamplingParams
from burstserve.engine.core.structured_output import StructuredRequest

PROMPT_TYPECODE = "i"   # int32 token ids (every vocabulary is far below 2**31): a prompt's form on the way to worker 0


class FinishReason(StrEnum):
    """Why a request ended; its value is OpenAI's `finish_reason` and the metrics' label."""
    STOP = "stop"            # a stop token, EOS, a stop string, or the grammar's end
    LENGTH = "length"        # max_tokens or the model's length
    ABORT = "abort"          # the client went away, an error, or a token off its grammar


@dataclass
class Request:
    """One prompt to run; sent to worker 0."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    return_logits: bool = False     # attach the next-token logits of the prompt to the first output
    structured: StructuredRequest | None = None   # set by LLM.submit when params.response_format constrains

    def __getstate__(self) -> dict:
        """Pickled (on its way to worker 0) with the prompt as an int32 array (PROMPT_TYPECODE): a
        long prompt then crosses in a little over half the time of pickling and unpickling it as a list."""
        state = dict(self.__dict__)
        ids = self.prompt_token_ids
        packed = isinstance(ids, array.array) and ids.typecode == PROMPT_TYPECODE
        state["prompt_token_ids"] = ids if packed else array.array(PROMPT_TYPECODE, ids)
        return state

    def __setstate__(self, state: dict) -> None:
        state["prompt_token_ids"] = state["prompt_token_ids"].tolist()
        self.__dict__.update(state)


@dataclass
class PrefillStats:
    """A prompt's prefill as the workers and worker 0's scheduler measured it: the first token's
    StepOutput.prefill, a request's RequestMetrics.prefill_stats. None: not measured for this prompt."""
    prefill_seconds: float | None = None        # the workers' own time (a prompt in chunks: all of them)
    strategy: str | None = None                 # the strategy's name; in chunks: the last chunk's ("extend", ...)
    shared_prefill: bool = False                # a copy of a running twin's K/V: nothing prefilled
    call_seconds: float | None = None           # the prefill call(s) as worker 0's scheduler saw them
    queued_seconds: float | None = None         # from its arrival to the scheduler taking it up
    setup_seconds: float | None = None
    wrapup_seconds: float | None = None
    cached_tokens: int | None = None            # tokens found in the prefix cache (an extend: before its own)
    host_cached_tokens: int | None = None       # of them, restored from the KV host tier
    adopt_seconds: float | None = None          # finding the cached prefix and copying it
    restore_seconds: float | None = None        # after a restore from the host tier: the copy's time
    restored_bytes: int | None = None           # ... and its bytes (this worker's)
    exchange_seconds: float | None = None       # the ring's exchanges alone, all layers (arithmetic)
    exposed_seconds: float | None = None        # compute stalled waiting for them
    exchange_overlapped_seconds: float | None = None
    hidden_fraction: float | None = None
    peak_memory_bytes: int | None = None
    chunks: int | None = None                   # in chunks: how many, their sizes, the ways they extended
    smallest_chunk: int | None = None
    largest_chunk: int | None = None
    extend_ways: dict | None = None             # ExtendWay value -> chunks
    graphed_extends: int | None = None          # of them, replayed as CUDA graphs
    mixed_chunks: int | None = None             # of them, with the running sequences' decode step in one call


@dataclass
class StepOutput:
    """One generated token of one request, from worker 0."""
    request_id: str
    token_id: int
    logprobs: dict[int, float] | None
    finish_reason: FinishReason | None   # None while running
    time: float                     # time.time() when the token existed
    prefill: PrefillStats | None = None   # on the first token
    logits: torch.Tensor | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None   # on the first token, when asked for


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    prefill_seconds: float | None = None      # measured on the workers, prefill alone
    decode_seconds: list[float] = field(default_factory=list)   # gap before each later token
    prefill_stats: PrefillStats = field(default_factory=PrefillStats)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logits: torch.Tensor | None = None   # only when asked for (LLM.next_token_logits)
    prompt_logprobs: list[dict[int, float] | None] | None = None   # SamplingParams.prompt_logprobs: per position


def request_output(request_id: str, prompt: str | None, prompt_ids: list[int], steps: Iterable[StepOutput],
                   arrival: float, decode: Callable[[list[int]], str]) -> RequestOutput:
    """A finished request's RequestOutput, from its StepOutputs in order (decode: token ids -> text)."""
    metrics = RequestMetrics(arrival_time=arrival)
    tokens, logprobs, reason, logits, last, prompt_logprobs = [], [], None, None, None, None
    for step in steps:
        if step.prefill is not None:
            metrics.first_token_time = step.time
            metrics.prefill_seconds = step.prefill.prefill_seconds
            metrics.prefill_stats = step.prefill
            logits, prompt_logprobs = step.logits, step.prompt_logprobs
        else:
            metrics.decode_seconds.append(step.time - last)
        last = step.time
        tokens.append(step.token_id)
        if step.logprobs is not None:
            logprobs.append(step.logprobs)
        reason = step.finish_reason
    metrics.finished_time = last
    cumulative = sum(lp[t] for lp, t in zip(logprobs, tokens)) if logprobs else None
    completion = CompletionOutput(0, decode(tokens), tokens, cumulative,
                                  logprobs if logprobs else None, reason)
    return RequestOutput(request_id, prompt, prompt_ids, [completion], True, metrics, logits, prompt_logprobs)

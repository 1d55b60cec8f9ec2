"""Results in the shape vLLM users know, and the per-token message workers send back."""
import array
from dataclasses import dataclass, field

import torch

from engine.sampling import SamplingParams
from engine.structured_output import StructuredRequest

PROMPT_TYPECODE = "i"   # int32 token ids (every vocabulary is far below 2**31): a prompt's form on the way to worker 0


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
class StepOutput:
    """One generated token of one request, from worker 0."""
    request_id: str
    token_id: int
    logprobs: dict[int, float] | None
    finish_reason: str | None       # None while running, else "stop", "length" or "abort"
    time: float                     # time.time() when the token existed
    prefill: dict | None = None     # on the first token: prefill_seconds, exchange/hidden figures
    logits: torch.Tensor | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None   # on the first token, when asked for


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    prefill_seconds: float | None = None      # measured on the workers, prefill alone
    decode_seconds: list[float] = field(default_factory=list)   # gap before each later token
    prefill_stats: dict = field(default_factory=dict)

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
    finish_reason: str | None


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

"""Sampling parameters (vLLM's names) and the sampler that runs on worker 0."""
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError
from engine.structured_output import parse_response_format

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # -1 or 0: all tokens
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None     # top-k logprobs per generated token (0 = only the chosen token)
    prompt_logprobs: int | None = None   # top-k logprobs per prompt position (the first has none)
    # OpenAI's response_format as-is: None or {"type": "text"} (free text), {"type": "json_object"}, or
    # {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}} (engine/structured_output.py)
    response_format: dict | None = None

    def __post_init__(self):
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (disabled) or positive, got {self.top_k}", "top_k")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name)
        parse_response_format(self.response_format)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A private generator for seeded requests: same seed, same tokens."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] fp32 -> one token id. With a response_format these are the grammar-masked logits
    (-inf where the grammar forbids), so temperature, top-k and top-p act on the allowed tokens only."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        beyond = (torch.cumsum(probs, dim=-1) - probs) > params.top_p    # keep the smallest set reaching top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(beyond, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> dict[int, float]:
    """{token_id: logprob} of the model's distribution: the chosen token and the `top` most likely."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    result = {}
    if top > 0:
        values, ids = torch.topk(logp, top)
        result = {int(i): float(v) for i, v in zip(ids, values)}
    result[token] = float(logp[token])
    return result

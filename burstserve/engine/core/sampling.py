"""Sampling parameters (vLLM's names) and the sampler that runs on worker 0."""
from dataclasses import dataclass, field

import torch

from burstserve.engine.core.devices import host_to_device
from burstserve.engine.core.errors import InvalidRequestError
from burstserve.engine.core.structured_output import parse_response_format

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
    # {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}} (engine/core/structured_output.py)
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


@dataclass(frozen=True)
class RowSampling:
    """How one row of a batch is sampled (small and picklable: it travels with the decode call to the
    worker that holds the logits)."""
    temperature: float = 0.0        # < 1e-5: greedy
    top_k: int = -1
    top_p: float = 1.0
    noise_seed: int | None = None   # seeded requests: this token's noise seed (see noise_seed); None: the device's RNG
    logprobs: int | None = None     # top-k logprobs wanted (0: the chosen token's only), None: none

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def row_sampling(params: SamplingParams, step: int) -> RowSampling:
    """The sampling of a request's token number `step` (0: the first generated token)."""
    seed = None if params.seed is None or params.greedy else noise_seed(params.seed, step)
    return RowSampling(params.temperature, params.top_k, params.top_p, seed, params.logprobs)


def noise_seed(seed: int, step: int) -> int:
    """One seed per (request seed, token index): a seeded request draws the same noise for its n-th
    token on every run, whatever else is in the batch, and after a preemption (no generator state to
    carry). A 64-bit mix (splitmix64's finalizer) of the pair."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def step_rules(rows: list[RowSampling]) -> list[RowSampling] | None:
    """A decode step's rules, or None where every row is greedy without logprobs: the step's argmax only."""
    return None if all(r.greedy and r.logprobs is None for r in rows) else rows


def sample_rows(logits: torch.Tensor, rows: list[RowSampling] | None) -> torch.Tensor:
    """logits [R, V] fp32 (any device) -> tokens [R] int64 on the same device, all rows at once (rows None:
    every row greedy):
    temperature, top-k, top-p (the smallest set of most likely tokens reaching top_p), then a draw
    by the exponential race (argmax of p / E, E ~ Exp(1): a draw from p). Greedy rows: the argmax.
    With a response_format these are grammar-masked logits (-inf where forbidden), so the filters act
    on the allowed tokens only. A few batched kernels plus one noise kernel per seeded row."""
    greedy = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows or []) if not r.greedy]
    if not sampled:
        return greedy
    device = logits.device
    x = logits.index_select(0, _to(device, sampled)) if len(sampled) < len(rows) else logits   # [S, V]
    v = x.shape[-1]
    picked = [rows[i] for i in sampled]
    x = x / _to(device, [r.temperature for r in picked])[:, None]
    ks = [r.top_k if 0 < r.top_k < v else v for r in picked]
    if min(ks) < v:
        top = torch.topk(x, max(k for k in ks if k < v), dim=-1).values                 # [S, kmax]
        kth = top.gather(1, _to(device, [min(k, top.shape[1]) - 1 for k in ks])[:, None])
        kth = kth.masked_fill(_to(device, [k == v for k in ks])[:, None], float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    if any(r.top_p < 1.0 for r in picked):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        top_p = _to(device, [r.top_p if r.top_p < 1.0 else 2.0 for r in picked])[:, None]
        beyond = (torch.cumsum(probs, dim=-1) - probs) > top_p                           # keep the smallest set reaching top_p
        x = x.scatter(1, order, sorted_x.masked_fill(beyond, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    tokens = (probs / _exponential_noise(picked, probs.shape, device)).argmax(dim=-1)
    return greedy.index_copy(0, _to(device, sampled), tokens)


def _to(device: torch.device, values: list) -> torch.Tensor:
    """A small list as a tensor on the device, the host not waiting for the device (a decode step's sampling
    is queued while the step before it may run: asynchronous scheduling)."""
    return host_to_device(torch.tensor(values), device)


def _exponential_noise(rows: list[RowSampling], shape, device) -> torch.Tensor:
    """E ~ Exp(1) [S, V]: seeded rows from their own noise seed, the others in one draw from the device's RNG."""
    noise = torch.empty(shape, device=device)
    seeded = [i for i, r in enumerate(rows) if r.noise_seed is not None]
    if len(seeded) < len(rows):
        noise.exponential_()
    for i in seeded:
        noise[i].exponential_(generator=torch.Generator(device=device).manual_seed(rows[i].noise_seed))
    return noise


def rows_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tops: list[int]) -> list[dict[int, float]]:
    """logits [R, V], tokens [R] (same device) -> per row {token_id: logprob} of the model's
    distribution: the chosen token and the `tops[r]` most likely. One host copy for all rows."""
    return logprob_entries(*top_logprobs(logits, tokens, max(tops, default=0)), tops)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, kmax: int) -> tuple:
    """logits [R, V], tokens [R] -> (the chosen tokens' logprobs [R] fp32, the kmax largest [R, kmax] fp32,
    their ids [R, kmax] int64, tokens [R]), on logits' device: what logprob_entries turns into entries once
    on the host (asynchronous scheduling copies them there without waiting)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1))[:, 0]
    values, ids = torch.topk(logp, kmax, dim=-1) if kmax > 0 else (logp[:, :0], logp[:, :0].long())
    return chosen, values, ids, tokens


def logprob_entries(chosen: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor,
                    tops: list[int]) -> list[dict[int, float]]:
    """top_logprobs' tensors -> per row {token_id: logprob}: the chosen token and the tops[r] most likely."""
    chosen, values, ids, tokens = chosen.tolist(), values.tolist(), ids.tolist(), tokens.tolist()   # one copy each
    out = []
    for r, top in enumerate(tops):
        entry = {int(i): float(lp) for i, lp in zip(ids[r][:top], values[r][:top])}
        entry[int(tokens[r])] = float(chosen[r])
        out.append(entry)
    return out


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> dict[int, float]:
    """{token_id: logprob} of the model's distribution [V]: the chosen token and the `top` most likely."""
    return rows_logprobs(logits[None], torch.tensor([token], device=logits.device), [top])[0]

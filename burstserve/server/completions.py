"""POST /v1/completions: validate, prompts, the engine, the response (in that order, one way)."""
import time
import uuid
from typing import Sequence

from burstserve.engine.core.outputs import FinishReason
from burstserve.server.choices import ChoiceEvent, sampling_params, start_choices
from burstserve.server.context import ServerContext
from burstserve.server.errors import APIError
from burstserve.server.logprobs import completion_logprob_entry, token_name
from burstserve.server.prompts import completion_prompts, resolve_max_tokens, stop_strings
from burstserve.server.protocol import CompletionRequest
from burstserve.server.streaming import json_response, stream_response
from burstserve.server.timeline import Timeline


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw=None):
    timeline = Timeline.start(raw)
    # 1. what the request's own fields cannot say (protocol.py checked those)
    ctx.check_model(req.model)
    if req.best_of not in (None, req.n):
        raise APIError(400, f"best_of={req.best_of!r} is not supported (only best_of equal to n)", "best_of")
    score_only = req.max_tokens == 0    # with echo: score the prompt only (lm-eval's loglikelihood)
    # 2. the prompts, checked against the model
    prompts = await completion_prompts(ctx, req.prompt)
    limits = [resolve_max_tokens(ctx, len(ids), 1 if score_only else req.max_tokens, "prompt")
              for _, ids in prompts]
    # 3. the engine: choice index = prompt index * n + j (OpenAI's order); a prompt's n choices share its prefill
    prompt_logprobs = req.logprobs if req.echo else None
    runs = [(ids, sampling_params(req, limit, req.logprobs, j, prompt_logprobs))
            for (_, ids), limit in zip(prompts, limits) for j in range(req.n)]
    writer = CompletionWriter(ctx, req, prompts, score_only)
    events = await start_choices(ctx, runs, stop_strings(req.stop), writer.id, timeline)
    # 4. the response
    if req.stream:
        return stream_response(writer.chunks(events))
    return await json_response(writer.body(events), raw)


class _Choice:
    """One choice's text and legacy logprobs as they accumulate."""

    def __init__(self, prefix: str, prompt_ids: Sequence[int]):
        self.prefix, self.text, self.tokens, self.finish_reason = prefix, prefix, 0, None
        self.cached_tokens = 0      # its prompt's tokens found in the prefix cache
        self.prompt_ids = prompt_ids
        self.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def append(self, entry: dict) -> dict:
        for k, v in entry.items():
            self.logprobs[k] += v
        return entry


class CompletionWriter:
    """Turns the choices' events into OpenAI's completion JSON, whole or as chunks."""

    def __init__(self, ctx: ServerContext, req: CompletionRequest, prompts: list, score_only: bool):
        self.ctx, self.req, self.prompts, self.score_only = ctx, req, prompts, score_only
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        tok = ctx.llm.tokenizer
        self.choices = [_Choice((text if text is not None else tok.decode(ids.tolist())) if req.echo else "", ids)
                        for text, ids in prompts for _ in range(req.n)]

    async def body(self, events) -> dict:
        async for event in events:
            self._absorb(event)
        return self._envelope([{"index": i, "text": ch.text, "finish_reason": ch.finish_reason,
                                "logprobs": ch.logprobs if self.req.logprobs is not None else None}
                               for i, ch in enumerate(self.choices)], usage=self._usage())

    async def chunks(self, events):
        if self.req.echo and self.req.logprobs is None:   # with logprobs the echo waits for the prompt's scores
            for i, ch in enumerate(self.choices):
                yield self._chunk(i, ch.text, None, None)
        async for event in events:
            prompt_entry, entry = self._absorb(event)
            if prompt_entry is not None:
                yield self._chunk(event.index, self.choices[event.index].prefix, prompt_entry, None)
            if self.score_only:
                yield self._chunk(event.index, "", None, FinishReason.LENGTH)
            else:
                yield self._chunk(event.index, event.text, entry, event.finish_reason)
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self._envelope([], usage=self._usage())

    def _absorb(self, event: ChoiceEvent) -> tuple[dict | None, dict | None]:
        """Adds an event to its choice; returns (the echoed prompt's logprobs, this token's), either None."""
        choice, req = self.choices[event.index], self.req
        prompt_entry = None
        if req.echo and req.logprobs is not None and event.prompt_logprobs is not None:
            prompt_entry = choice.append(self._prompt_entry(choice.prompt_ids, event.prompt_logprobs))
        if self.score_only:   # max_tokens 0: the one token generated to end the prefill is not part of the answer
            choice.finish_reason = FinishReason.LENGTH
            return prompt_entry, None
        choice.text += event.text
        choice.tokens += 1
        choice.cached_tokens = max(choice.cached_tokens, event.cached_tokens or 0)
        choice.finish_reason = event.finish_reason
        if req.logprobs is None or event.logprobs is None:
            return prompt_entry, None
        name, lp, top = completion_logprob_entry(self.ctx.llm.tokenizer, event.token_id, event.logprobs,
                                                 req.logprobs, req.return_tokens_as_token_ids)
        offset = len(choice.prefix) + event.text_offset
        return prompt_entry, choice.append({"tokens": [name], "token_logprobs": [lp], "top_logprobs": [top],
                                            "text_offset": [offset]})

    def _prompt_entry(self, prompt_ids: Sequence[int], scored: list) -> dict:
        """The echoed prompt's logprobs (its first token has none), offsets counted from the text's start."""
        tok, req = self.ctx.llm.tokenizer, self.req
        entry, offset = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, 0
        for token_id, top in zip(prompt_ids, scored):
            if top is None:
                name, lp, tops = token_name(tok, token_id, req.return_tokens_as_token_ids)[0], None, None
            else:
                name, lp, tops = completion_logprob_entry(tok, token_id, top, req.logprobs,
                                                          req.return_tokens_as_token_ids)
            for key, value in zip(entry, (name, lp, tops, offset)):
                entry[key].append(value)
            offset += len(tok.decode([token_id]))
        return entry

    def _usage(self) -> dict:
        p = sum(len(ids) for _, ids in self.prompts)
        c = sum(ch.tokens for ch in self.choices)
        n = self.req.n
        cached = sum(max(ch.cached_tokens for ch in self.choices[i:i + n]) for i in range(0, len(self.choices), n))
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _chunk(self, index: int, text: str, logprobs: dict | None, finish_reason: FinishReason | None) -> dict:
        return self._envelope([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])

    def _envelope(self, choices: list, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model_name,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

"""POST /v1/completions."""
import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from server.errors import APIError
from server.protocol import CompletionRequest
from server.serving import (ServerContext, check_model, check_n, check_token_ids, encode_text, make_params,
                            merge_choices, refuse_unsupported, resolve_max_tokens, run_choice, sse, sse_error,
                            stop_strings, unless_disconnected)
from server.text import completion_logprob_entry, token_text

UNSUPPORTED = {"suffix": None, "logit_bias": None, "frequency_penalty": 0.0, "presence_penalty": 0.0}


async def _prompts(ctx: ServerContext, prompt) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) for each prompt in the request."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "the prompt is empty", "prompt")
    out = []
    for item in items:
        ids = await encode_text(ctx, item) if isinstance(item, str) else list(item)
        out.append((item if isinstance(item, str) else None, check_token_ids(ctx, ids)))
    return out


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw=None):
    check_model(ctx, req.model)
    refuse_unsupported(req, UNSUPPORTED)
    n = check_n(req.n)
    if req.best_of not in (None, 1, n):
        raise APIError(400, f"best_of={req.best_of!r} is not supported (only best_of equal to n)", "best_of")
    score_only = req.echo and req.max_tokens == 0    # the legacy way to score a prompt (lm-eval's loglikelihood)
    prompts = await _prompts(ctx, req.prompt)
    stops = stop_strings(req.stop)
    max_tokens = [resolve_max_tokens(ctx, len(ids), 1 if score_only else req.max_tokens, "prompt")
                  for _, ids in prompts]
    prompt_logprobs = req.logprobs if req.echo else None
    ctx.engine.admit(len(prompts) * n)
    # choice index = prompt index * n + j (OpenAI's order); the n choices of a prompt share its prefill
    streams = [run_choice(ctx, i * n + j, ids, make_params(req, m, req.logprobs, j, prompt_logprobs), stops)
               for i, ((_, ids), m) in enumerate(zip(prompts, max_tokens)) for j in range(n)]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(ctx, req, prompts, n, streams, rid, created, include_usage, score_only),
                                 media_type="text/event-stream")
    return JSONResponse(await unless_disconnected(
        _collect(ctx, req, prompts, n, streams, rid, created, score_only), raw))


class _Choice:
    def __init__(self, prefix: str, prompt_ids: list[int], score_only: bool):
        self.text, self.tokens, self.finish_reason = prefix, 0, None
        self.prompt_ids, self.score_only = prompt_ids, score_only
        self.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add_prompt(self, ctx, req, prompt_logprobs: list) -> dict:
        """The echoed prompt's logprobs (its first token has none), offsets counted from the text's start."""
        tok, entry, offset = ctx.llm.tokenizer, {k: [] for k in self.logprobs}, 0
        as_ids = req.return_tokens_as_token_ids
        for token_id, scored in zip(self.prompt_ids, prompt_logprobs):
            if scored is None:
                name, lp, top = token_text(tok, token_id, as_ids), None, None
            else:
                name, lp, top = completion_logprob_entry(tok, token_id, scored, req.logprobs, as_ids)
            for key, value in zip(("tokens", "token_logprobs", "top_logprobs", "text_offset"), (name, lp, top, offset)):
                entry[key].append(value)
            offset += len(tok.decode([token_id]) if as_ids else name)   # name is the token's text unless as_ids
        for k, v in entry.items():
            self.logprobs[k] += v
        return entry

    def add(self, ctx, req, event) -> dict | None:
        """Absorbs an event; returns this event's logprobs in the legacy format (or None)."""
        if self.score_only:   # max_tokens 0: the one token generated to end the prefill is not part of the answer
            self.finish_reason = "length"
            return None
        offset = len(self.text)
        self.text += event.text
        self.tokens += 1
        self.finish_reason = event.finish_reason
        if req.logprobs is None or event.logprobs is None:
            return None
        token, lp, top = completion_logprob_entry(ctx.llm.tokenizer, event.token_id, event.logprobs, req.logprobs,
                                                  req.return_tokens_as_token_ids)
        entry = {"tokens": [token], "token_logprobs": [lp], "top_logprobs": [top], "text_offset": [offset]}
        for k, v in entry.items():
            self.logprobs[k] += v
        return entry


def _usage(prompts, choices) -> dict:
    p = sum(len(ids) for _, ids in prompts)
    c = sum(ch.tokens for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _prefix(ctx, req, prompt) -> str:
    text, ids = prompt
    return (text if text is not None else ctx.llm.tokenizer.decode(ids)) if req.echo else ""


def _choices(ctx, req, prompts, n, score_only) -> list[_Choice]:
    return [_Choice(_prefix(ctx, req, p), p[1], score_only) for p in prompts for _ in range(n)]


def _scores_prompt(req, event) -> bool:
    return req.echo and req.logprobs is not None and event.prompt_logprobs is not None


async def _collect(ctx, req, prompts, n, streams, rid, created, score_only) -> dict:
    choices = _choices(ctx, req, prompts, n, score_only)
    async for event in merge_choices(streams):
        if _scores_prompt(req, event):
            choices[event.index].add_prompt(ctx, req, event.prompt_logprobs)
        choices[event.index].add(ctx, req, event)
    return {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
            "choices": [{"index": i, "text": ch.text, "logprobs": ch.logprobs if req.logprobs is not None else None,
                         "finish_reason": ch.finish_reason} for i, ch in enumerate(choices)],
            "usage": _usage(prompts, choices)}


async def _stream(ctx, req, prompts, n, streams, rid, created, include_usage, score_only):
    choices = _choices(ctx, req, prompts, n, score_only)

    def chunk(index, text, logprobs, finish_reason):
        return {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    try:
        if req.echo and req.logprobs is None:   # with logprobs the echo waits for the prompt's scores
            for i in range(len(choices)):
                yield sse(chunk(i, choices[i].text, None, None))
        async for event in merge_choices(streams):
            choice = choices[event.index]
            if _scores_prompt(req, event):
                yield sse(chunk(event.index, choice.text, choice.add_prompt(ctx, req, event.prompt_logprobs), None))
            entry = choice.add(ctx, req, event)
            if score_only:
                yield sse(chunk(event.index, "", None, "length"))
            else:
                yield sse(chunk(event.index, event.text, entry, event.finish_reason))
        if include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                       "choices": [], "usage": _usage(prompts, choices)})
    except Exception as e:  # after the stream started: an error event, then the end
        yield sse_error(e)
    yield sse("[DONE]")

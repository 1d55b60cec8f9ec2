"""POST /v1/completions."""
import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from server.errors import APIError
from server.protocol import CompletionRequest
from server.serving import (ServerContext, check_model, check_n, check_token_ids, encode_text, make_params,
                            merge_choices, refuse_unsupported, resolve_max_tokens, run_choice, sse, sse_error,
                            stop_strings, unless_disconnected)
from server.text import completion_logprob_entry

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
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (prompt logprobs are not computed)", "echo")
    prompts = await _prompts(ctx, req.prompt)
    stops = stop_strings(req.stop)
    max_tokens = [resolve_max_tokens(ctx, len(ids), req.max_tokens, "prompt") for _, ids in prompts]
    ctx.engine.admit(len(prompts) * n)
    # choice index = prompt index * n + j (OpenAI's order); the n choices of a prompt share its prefill
    streams = [run_choice(ctx, i * n + j, ids, make_params(req, m, req.logprobs, j), stops)
               for i, ((_, ids), m) in enumerate(zip(prompts, max_tokens)) for j in range(n)]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(ctx, req, prompts, n, streams, rid, created, include_usage),
                                 media_type="text/event-stream")
    return JSONResponse(await unless_disconnected(_collect(ctx, req, prompts, n, streams, rid, created), raw))


class _Choice:
    def __init__(self, prefix: str):
        self.text, self.tokens, self.finish_reason = prefix, 0, None
        self.logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, ctx, req, event) -> dict | None:
        """Absorbs an event; returns this event's logprobs in the legacy format (or None)."""
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


async def _collect(ctx, req, prompts, n, streams, rid, created) -> dict:
    choices = [_Choice(_prefix(ctx, req, p)) for p in prompts for _ in range(n)]
    async for event in merge_choices(streams):
        choices[event.index].add(ctx, req, event)
    return {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
            "choices": [{"index": i, "text": ch.text, "logprobs": ch.logprobs if req.logprobs is not None else None,
                         "finish_reason": ch.finish_reason} for i, ch in enumerate(choices)],
            "usage": _usage(prompts, choices)}


async def _stream(ctx, req, prompts, n, streams, rid, created, include_usage):
    choices = [_Choice("") for _ in prompts for _ in range(n)]

    def chunk(index, text, logprobs, finish_reason):
        return {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    try:
        if req.echo:
            for i in range(len(choices)):
                yield sse(chunk(i, _prefix(ctx, req, prompts[i // n]), None, None))
        async for event in merge_choices(streams):
            entry = choices[event.index].add(ctx, req, event)
            yield sse(chunk(event.index, event.text, entry, event.finish_reason))
        if include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                       "choices": [], "usage": _usage(prompts, choices)})
    except Exception as e:  # after the stream started: an error event, then the end
        yield sse_error(e)
    yield sse("[DONE]")

"""POST /v1/chat/completions."""
import time
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.serving import (ServerContext, check_model, check_n, check_token_ids, make_params, merge_choices,
                            refuse_unsupported, resolve_max_tokens, run_choice, sse, sse_error, stop_strings,
                            unless_disconnected)
from server.text import chat_logprob_entry

UNSUPPORTED = {"logit_bias": None, "frequency_penalty": 0.0, "presence_penalty": 0.0}
# Used when the tokenizer has no chat template (documented in the README):
#   <|system|>\n{content}\n<|user|>\n{content}\n ... <|assistant|>\n
SIMPLE_TEMPLATE_ROLE = "<|{role}|>\n{content}\n"


def _text_content(message) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(400, f"message content of type {part.get('type')!r} is not supported (text only)",
                           "messages")
        parts.append(part.get("text", ""))
    return "".join(parts)


def render_prompt_ids(ctx: ServerContext, req: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": _text_content(m)} for m in req.messages]
    tok = ctx.llm.tokenizer
    if getattr(tok, "chat_template", None):
        ids = tok.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return list(ids)
    text = "".join(SIMPLE_TEMPLATE_ROLE.format(**m) for m in messages) + "<|assistant|>\n"
    return tok.encode(text)


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw=None):
    check_model(ctx, req.model)
    refuse_unsupported(req, UNSUPPORTED)
    n = check_n(req.n)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    ids = check_token_ids(ctx, render_prompt_ids(ctx, req))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(ctx, len(ids), requested, "messages")
    top = req.top_logprobs or 0
    ctx.engine.admit(n)
    stops = stop_strings(req.stop)   # the n choices share one prefill
    streams = [run_choice(ctx, j, ids, make_params(req, max_tokens, top if req.logprobs else None, j), stops)
               for j in range(n)]
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(ctx, req, len(ids), streams, rid, created, include_usage),
                                 media_type="text/event-stream")
    return JSONResponse(await unless_disconnected(_collect(ctx, req, ids, streams, rid, created, top), raw))


async def _collect(ctx, req, ids, streams, rid, created, top) -> dict:
    texts, entries, reasons = [""] * len(streams), [[] for _ in streams], [None] * len(streams)
    tokens = 0
    async for event in merge_choices(streams):
        i = event.index
        texts[i] += event.text
        tokens += 1
        reasons[i] = event.finish_reason
        if req.logprobs and event.logprobs is not None:
            entries[i].append(chat_logprob_entry(ctx.llm.tokenizer, event.token_id, event.logprobs, top,
                                                 req.return_tokens_as_token_ids))
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
        "choices": [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                     "logprobs": {"content": entries[i]} if req.logprobs else None, "finish_reason": reasons[i]}
                    for i in range(len(streams))],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": tokens, "total_tokens": len(ids) + tokens}}


async def _stream(ctx, req, prompt_tokens, streams, rid, created, include_usage):
    def chunk(index, delta, logprobs=None, finish_reason=None):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    tokens = 0
    try:
        for i in range(len(streams)):
            yield sse(chunk(i, {"role": "assistant", "content": ""}))
        async for event in merge_choices(streams):
            tokens += 1
            logprobs = None
            if req.logprobs and event.logprobs is not None:
                logprobs = {"content": [chat_logprob_entry(ctx.llm.tokenizer, event.token_id, event.logprobs,
                                                           req.top_logprobs or 0, req.return_tokens_as_token_ids)]}
            yield sse(chunk(event.index, {"content": event.text}, logprobs, event.finish_reason))
        if include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                       "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                                                "total_tokens": prompt_tokens + tokens}})
    except Exception as e:  # after the stream started: an error event, then the end
        yield sse_error(e)
    yield sse("[DONE]")

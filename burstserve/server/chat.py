"""POST /v1/chat/completions: validate, prompt, the engine, the response (in that order, one way)."""
import time
import uuid

from burstserve.engine.core.outputs import FinishReason
from burstserve.server.choices import ChoiceEvent, sampling_params, start_choices
from burstserve.server.context import ServerContext
from burstserve.server.logprobs import chat_logprob_entry
from burstserve.server.prompts import chat_prompt, resolve_max_tokens, stop_strings
from burstserve.server.protocol import ChatCompletionRequest
from burstserve.server.streaming import json_response, stream_response
from burstserve.server.timeline import Timeline


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw=None):
    timeline = Timeline.start(raw)
    # 1. what the request's own fields cannot say (protocol.py checked those)
    ctx.check_model(req.model)
    # 2. the prompt, checked against the model
    ids = await chat_prompt(ctx, req)
    requested, field = req.requested_max_tokens
    max_tokens = resolve_max_tokens(ctx, len(ids), requested, "messages", field)
    # 3. the engine: the n choices share one prefill
    top = (req.top_logprobs or 0) if req.logprobs else None
    writer = ChatWriter(ctx, req, len(ids))
    events = await start_choices(ctx, [(ids, sampling_params(req, max_tokens, top, j)) for j in range(req.n)],
                                 stop_strings(req.stop), writer.id, timeline)
    # 4. the response
    if req.stream:
        return stream_response(writer.chunks(events))
    return await json_response(writer.body(events), raw)


class ChatWriter:
    """Turns the choices' events into OpenAI's chat completion JSON, whole or as chunks."""

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, prompt_tokens: int):
        self.ctx, self.req, self.prompt_tokens = ctx, req, prompt_tokens
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.tokens = 0
        self.cached_tokens = 0      # the prompt's tokens found in the prefix cache (the most over the choices)

    async def body(self, events) -> dict:
        n = self.req.n
        texts, entries, reasons = [""] * n, [[] for _ in range(n)], [None] * n
        async for event in events:
            i = event.index
            texts[i] += event.text
            reasons[i] = event.finish_reason
            entry = self._logprobs(event)
            if entry is not None:
                entries[i].append(entry)
        choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                    "logprobs": {"content": entries[i]} if self.req.logprobs else None, "finish_reason": reasons[i]}
                   for i in range(n)]
        return self._envelope("chat.completion", choices, usage=self._usage())

    async def chunks(self, events):
        for i in range(self.req.n):
            yield self._chunk(i, {"role": "assistant", "content": ""})
        async for event in events:
            entry = self._logprobs(event)
            yield self._chunk(event.index, {"content": event.text},
                              {"content": [entry]} if entry is not None else None, event.finish_reason)
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self._envelope("chat.completion.chunk", [], usage=self._usage())

    def _logprobs(self, event: ChoiceEvent) -> dict | None:
        """Counts the token; its logprobs entry when asked for."""
        self.tokens += 1
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens or 0)
        if not self.req.logprobs or event.logprobs is None:
            return None
        return chat_logprob_entry(self.ctx.llm.tokenizer, event.token_id, event.logprobs, self.req.top_logprobs or 0,
                                  self.req.return_tokens_as_token_ids)

    def _usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def _chunk(self, index: int, delta: dict, logprobs: dict | None = None, finish_reason: FinishReason | None = None) -> dict:
        return self._envelope("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                         "finish_reason": finish_reason}])

    def _envelope(self, kind: str, choices: list, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.ctx.model_name,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

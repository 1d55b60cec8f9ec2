"""What completions and chat share: model check, prompt checks, sampling params, running choices."""
import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import AsyncIterator

from engine import LLM, SamplingParams
from server.async_engine import AsyncEngine
from server.errors import APIError, ClientGone, as_api_error, error_body
from server.text import TextAssembler


@dataclass
class ServerContext:
    llm: LLM
    engine: AsyncEngine
    model_name: str


@dataclass
class ChoiceEvent:
    index: int
    text: str                      # new text, safe to send
    token_id: int
    logprobs: dict[int, float] | None
    finish_reason: str | None      # "stop" or "length" on the last event
    prompt_logprobs: list | None = None   # on the first event, when asked for: one entry per prompt token


def check_model(ctx: ServerContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model")


def refuse_unsupported(req, fields: dict) -> None:
    """A 400 naming the first OpenAI field set to something this server does not do."""
    for name, default in fields.items():
        value = getattr(req, name, default)
        if value not in (default, None):
            raise APIError(400, f"{name}={value!r} is not supported (only {default!r})", name)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 16:
        raise APIError(400, f"at most 16 stop strings, got {len(stops)}", "stop")
    return stops


def resolve_max_tokens(ctx: ServerContext, prompt_tokens: int, requested: int | None, where: str) -> int:
    """The tokens to generate; a 400 in vLLM's words when prompt + max_tokens exceed the context."""
    limit = ctx.llm.max_model_len
    if requested is not None and requested < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {requested}", "max_tokens")
    if prompt_tokens > limit or (requested is not None and prompt_tokens + requested > limit):
        asked = prompt_tokens + (requested or 0)
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{asked} tokens ({prompt_tokens} in the {where}, {requested or 0} in the completion). "
                            f"Please reduce the length of the {where} or completion.", where)
    max_tokens = requested if requested is not None else limit - prompt_tokens
    if max_tokens < 1:
        raise APIError(400, f"the {where} fills the model's whole context of {limit} tokens", where)
    ctx.llm.check_fits(prompt_tokens, max_tokens)
    return max_tokens


MAX_N = 64


def check_n(n: int) -> int:
    """The number of choices per prompt, 1..MAX_N."""
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be between 1 and {MAX_N}, got {n}", "n")
    return n


def make_params(req, max_tokens: int, logprobs: int | None, choice: int = 0,
                prompt_logprobs: int | None = None) -> SamplingParams:
    """Choice j of a prompt samples with seed + j, so a seeded request's n choices differ but repeat."""
    seed = None if req.seed is None else req.seed + choice
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_tokens=max_tokens,
                          seed=seed, stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def check_token_ids(ctx: ServerContext, ids: list[int]) -> list[int]:
    vocab = ctx.llm.model_config.vocab_size
    if not ids:
        raise APIError(400, "the prompt is empty", "prompt")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
    return ids


async def encode_text(ctx: ServerContext, text: str) -> list[int]:
    """Tokenizes off the event loop (a book-length prompt takes a while)."""
    return await asyncio.get_running_loop().run_in_executor(None, ctx.llm.tokenizer.encode, text)


async def run_choice(ctx: ServerContext, index: int, prompt_ids: list[int], params: SamplingParams,
                     stops: list[str]) -> AsyncIterator[ChoiceEvent]:
    """One prompt's tokens as text deltas; stops early (aborting the request) at a stop string."""
    assembler = TextAssembler(ctx.llm.tokenizer, stops)
    async with contextlib.aclosing(ctx.engine.generate(prompt_ids, params)) as steps:
        async for step in steps:
            text = assembler.add(step.token_id)
            reason = "stop" if assembler.stopped else step.finish_reason
            if reason is not None and not assembler.stopped:
                text += assembler.finish()
                reason = "stop" if assembler.stopped else reason   # the last characters completed a stop
            yield ChoiceEvent(index, text, step.token_id, step.logprobs, reason, step.prompt_logprobs)
            if reason is not None:
                return


async def merge_choices(streams: list[AsyncIterator[ChoiceEvent]]) -> AsyncIterator[ChoiceEvent]:
    """Interleaves several choices' events as they come; cancelling this cancels them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for event in only:
                yield event
        return
    inbox: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for event in stream:
                await inbox.put(event)
            await inbox.put(done)
        except BaseException as e:   # handed to the consumer, which re-raises it
            await inbox.put(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await inbox.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def unless_disconnected(work, request, poll_seconds: float = 0.2):
    """Awaits `work` (a coroutine) inline, so admission stays atomic; a watcher cancels it if the
    client disconnects first (aborting its engine requests, which frees their KV): ClientGone."""
    if request is None:
        return await work
    handler = asyncio.current_task()
    gone = False

    async def watch():
        nonlocal gone
        while not await request.is_disconnected():
            await asyncio.sleep(poll_seconds)
        gone = True
        handler.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        handler.uncancel()
        raise ClientGone() from None
    finally:
        watcher.cancel()


def sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


def sse_error(exc: Exception) -> str:
    err = as_api_error(exc)
    return sse(error_body(err.status, err.message, err.param))

"""The engine side of a request: each choice is one engine request whose tokens become text deltas
(stop strings cut here); several choices are interleaved as their tokens come."""
import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from burstserve.engine import SamplingParams
from burstserve.engine.core.outputs import FinishReason
from burstserve.server.context import ServerContext
from burstserve.server.text import TextAssembler
from burstserve.server.timeline import Timeline


@dataclass
class ChoiceEvent:
    index: int
    text: str                      # new text, safe to send
    text_offset: int               # where this token's text starts in the choice's generated text
    token_id: int
    logprobs: dict[int, float] | None
    finish_reason: FinishReason | None      # on the last event
    prompt_logprobs: list | None = None   # on the first event, when asked for: one entry per prompt token
    cached_tokens: int | None = None      # on the first event: prompt tokens found in the prefix cache


def sampling_params(req, max_tokens: int, logprobs: int | None, choice: int = 0,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """Choice j of a prompt samples with seed + j, so a seeded request's n choices differ but repeat."""
    seed = None if req.seed is None else req.seed + choice
    response_format = req.response_format.for_engine() if req.response_format is not None else None
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_tokens=max_tokens,
                          seed=seed, stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs, response_format=response_format)


async def start_choices(ctx: ServerContext, runs: list[tuple[list[int], SamplingParams]],
                        stops: list[str], response_id: str, timeline: Timeline) -> AsyncIterator[ChoiceEvent]:
    """Checks what only the engine can (a response_format's schema compiles: off the event loop, the
    first one imports xgrammar) and admits the choices (429/503), all before a response starts;
    then runs them: choice i is runs[i], its engine request `{response_id}-{i}` (the log names it)."""
    if runs and runs[0][1].response_format is not None:   # every choice of a request has the same format
        await asyncio.get_running_loop().run_in_executor(None, ctx.llm.structured_request, runs[0][1])
    ctx.engine.admit(len(runs))
    return merge_choices([run_choice(ctx, i, ids, params, stops, f"{response_id}-{i}", timeline)
                          for i, (ids, params) in enumerate(runs)])


async def run_choice(ctx: ServerContext, index: int, prompt_ids: Sequence[int], params: SamplingParams,
                     stops: list[str], request_id: str, timeline: Timeline) -> AsyncIterator[ChoiceEvent]:
    """One prompt's tokens as text deltas; a stop string ends the request early."""
    assembler = TextAssembler(ctx.llm.tokenizer, stops)
    request = ctx.engine.start(prompt_ids, params, request_id, timeline)
    try:
        async for step in request:
            offset = len(assembler.text)
            text = assembler.add(step.token_id)
            reason = FinishReason.STOP if assembler.stopped else step.finish_reason
            if reason is not None and not assembler.stopped:
                text += assembler.finish()
                reason = FinishReason.STOP if assembler.stopped else reason   # the last characters completed a stop
            if assembler.stopped:
                request.close(FinishReason.STOP)
            cached = (step.prefill.cached_tokens or 0) if step.prefill is not None else None
            yield ChoiceEvent(index, text, offset, step.token_id, step.logprobs, reason, step.prompt_logprobs, cached)
            if reason is not None:
                return
    finally:
        request.close(FinishReason.ABORT)   # the client went away, or an error: a no-op once the request ended


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
            async with contextlib.aclosing(stream):
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

"""How a response leaves: as server-sent events, or as one JSON body that is cancelled (with its
engine requests) when the client goes away first."""
import asyncio
import json
from typing import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from burstserve.server.errors import ClientGone, as_api_error, error_body


def sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


def sse_error(exc: Exception) -> str:
    err = as_api_error(exc)
    return sse(error_body(err.status, err.message, err.param, err.code))


async def event_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The chunks as SSE; an error after the stream started becomes an error event; then [DONE]."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except Exception as e:
        yield sse_error(e)
    yield sse("[DONE]")


def stream_response(chunks: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(event_stream(chunks), media_type="text/event-stream")


async def json_response(body: Awaitable[dict], request: Request | None) -> JSONResponse:
    return JSONResponse(await unless_disconnected(body, request))


async def unless_disconnected(work: Awaitable, request: Request | None, poll_seconds: float = 0.2):
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

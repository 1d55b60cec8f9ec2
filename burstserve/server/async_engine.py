"""The bridge between the asyncio front end and the engine's worker processes.

The front end never runs model code: `LLM` here only holds queues to the workers and a router
thread. Each request is an `EngineRequest`: an async iterator over its tokens that the router
thread fills (thread-safely). However a request ends (its last token, a stop string, the client
gone, the engine dead) it ends through `close`, once: that aborts it in the engine if it still
runs (freeing its KV at once), counts it in the metrics and writes its log line.
"""
import asyncio
import dataclasses
import itertools
import logging
import time
from typing import Sequence

from burstserve.engine import LLM, SamplingParams
from burstserve.engine.core.errors import EngineDeadError
from burstserve.engine.core.outputs import FinishReason, StepOutput
from burstserve.server.errors import APIError
from burstserve.server.metrics import Metrics
from burstserve.server.timeline import Timeline

log = logging.getLogger("burstserve.requests")


class AsyncEngine:
    def __init__(self, llm: LLM, metrics: Metrics, max_waiting: int, log_requests: bool = True):
        self.llm, self.metrics, self.max_waiting = llm, metrics, max_waiting
        self.log_requests = log_requests
        self.waiting = 0                 # submitted, no token yet
        self.prompt_tokens = 0           # totals since start, for the periodic stats line
        self.generation_tokens = 0
        self.live: set[EngineRequest] = set()
        self.closing = False             # shutting down: no new requests, the live ones end with a 503
        self.loop: asyncio.AbstractEventLoop | None = None   # the server's, set at start-up
        self._ids = itertools.count()

    @property
    def healthy(self) -> bool:
        return self.llm.dead_reason is None

    def admit(self, num_prompts: int) -> None:
        """Checked before a response starts: 503 if the engine is down, 429 if the queue is full."""
        if self.closing:
            raise APIError(503, "the server is shutting down")
        if not self.healthy:
            raise APIError(503, f"the engine is not running: {self.llm.dead_reason.splitlines()[0]}")
        if self.waiting + num_prompts > self.max_waiting:
            raise APIError(429, f"the server is busy: {self.waiting} requests are already waiting for their "
                                f"first token (--max-waiting {self.max_waiting})", headers={"Retry-After": "1"})

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
              timeline: Timeline | None = None) -> "EngineRequest":
        """`request_id`: the id the client sees (with the choice's index), so the log names it;
        `timeline`: when the HTTP request arrived and was parsed (its TTFT counts from the arrival)."""
        timeline = dataclasses.replace(timeline) if timeline is not None else Timeline.start()
        return EngineRequest(self, request_id or f"srv-{next(self._ids)}", prompt_ids, params, timeline)

    def shut_down(self) -> None:
        """At SIGTERM (called on the event loop): refuse new requests and end every live one with a
        503 (a stream gets an error event and [DONE]), so the server can close its connections now."""
        self.closing = True
        for request in list(self.live):
            request.fail(APIError(503, "the server is shutting down"))


class EngineRequest:
    """One prompt's tokens as they exist: `async for step in request`; raises EngineDeadError if
    the engine dies. `close(reason)` ends it early; it is a no-op once the request ended."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                 timeline: Timeline):
        self.engine, self.request_id, self.prompt_tokens = engine, request_id, len(prompt_ids)
        loop = asyncio.get_running_loop()
        self._inbox: asyncio.Queue = asyncio.Queue()
        self.timeline = timeline
        self.arrival = self._last = timeline.received
        self.first_token_time: float | None = None
        self._ttft_parts = ""         # the TTFT's parts for the log line (server/timeline.py)
        self.generated = 0
        self.finish_reason: FinishReason | None = None
        timeline.submitted = time.time()
        engine.llm.submit(prompt_ids, params, request_id,
                          sink=lambda item: loop.call_soon_threadsafe(self._inbox.put_nowait, item))
        engine.waiting += 1
        engine.live.add(self)

    def __aiter__(self) -> "EngineRequest":
        return self

    async def __anext__(self) -> StepOutput:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        item = await self._inbox.get()
        if isinstance(item, BaseException):   # the engine died (nothing to abort), or the server shuts down
            self._end("error", time.time(), abort=not isinstance(item, EngineDeadError))
            raise item
        self._count(item)
        if item.finish_reason is not None:
            self._end(item.finish_reason, item.time, abort=False)
        return item

    def fail(self, error: Exception) -> None:
        """Ends the request with `error`, raised to its reader at its next read (none once it ended)."""
        self._inbox.put_nowait(error)

    def close(self, reason: FinishReason = FinishReason.ABORT) -> None:
        """Ends the request (aborting it in the engine) unless it already ended."""
        if self.finish_reason is None:
            self._end(reason, time.time(), abort=True)

    def _count(self, item: StepOutput) -> None:
        engine, m = self.engine, self.engine.metrics
        self.generated += 1
        engine.generation_tokens += 1
        if self.first_token_time is None:
            self.first_token_time = item.time
            self.timeline.delivered = time.time()
            self._ttft_parts = self.timeline.describe(item.time, item.prefill)
            engine.waiting -= 1
            if item.prefill is None or not item.prefill.shared_prefill:
                engine.prompt_tokens += self.prompt_tokens
            m.first_token(item, self.arrival, self.prompt_tokens)
        else:
            m.next_token(item.time - self._last)
        self._last = item.time

    def _end(self, reason: FinishReason, when: float, abort: bool) -> None:
        self.finish_reason = reason
        self.engine.live.discard(self)
        if self.first_token_time is None:
            self.engine.waiting -= 1
        if abort:
            self.engine.llm.abort(self.request_id)
        self.engine.metrics.finished(reason, when - self.arrival)
        if self.engine.log_requests:
            ttft = self._ttft_parts or "no first token"
            log.info("request %s finished (%s): %d prompt tokens, %s, %d output tokens, %.3f s",
                     self.request_id, reason, self.prompt_tokens, ttft, self.generated, when - self.arrival)

"""The bridge between the asyncio front end and the engine's worker processes.

The front end never runs model code: `LLM` here only holds queues to the workers and a router
thread. Each request gets an asyncio queue that the router thread fills (thread-safely); a
request whose consumer goes away (client disconnected) is aborted, freeing its KV at once.
"""
import asyncio
import itertools
import time
from typing import AsyncIterator

from engine import LLM, SamplingParams
from engine.outputs import StepOutput
from server.errors import APIError
from server.metrics import Metrics


class AsyncEngine:
    def __init__(self, llm: LLM, metrics: Metrics, max_waiting: int):
        self.llm, self.metrics, self.max_waiting = llm, metrics, max_waiting
        self.waiting = 0          # submitted, no token yet
        self._ids = itertools.count()

    @property
    def healthy(self) -> bool:
        return self.llm.dead_reason is None

    def admit(self, num_prompts: int) -> None:
        """Checked before a response starts: 503 if the engine is down, 429 if the queue is full."""
        if not self.healthy:
            raise APIError(503, "the engine is not running")
        if self.waiting + num_prompts > self.max_waiting:
            raise APIError(429, f"the server is busy: {self.waiting} requests are already waiting for their "
                                f"first token (--max-waiting {self.max_waiting})", headers={"Retry-After": "1"})

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Yields the request's tokens as they exist; raises EngineDeadError if the engine dies."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        request_id = f"srv-{next(self._ids)}"
        arrival = time.time()
        self.llm.submit(prompt_ids, params, request_id, sink=lambda item: loop.call_soon_threadsafe(inbox.put_nowait, item))
        self.waiting += 1
        started = finished = False
        last, generated = arrival, 0
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, BaseException):
                    raise item
                generated += 1
                if not started:
                    started = True
                    self.waiting -= 1
                    self.metrics.first_token(item, arrival, len(prompt_ids))
                else:
                    self.metrics.next_token(item.time - last)
                last = item.time
                if item.finish_reason is not None:
                    finished = True
                    self.metrics.finished(item.finish_reason, item.time - arrival)
                yield item
                if finished:
                    return
        finally:
            if not started:
                self.waiting -= 1
            if not finished:
                self.llm.abort(request_id)

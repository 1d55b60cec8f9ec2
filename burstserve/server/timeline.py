"""Where an HTTP request's time to first token goes, from the server's side: the moments it passed
(time.time(), comparable with the workers' token times on one host) and the line the request log
prints from them:

    TTFT 10111.0 ms = read 9.1 ms + checks 5.2 ms + engine 10094.6 ms (queued 0.4, prefill 10042.9, between 51.3)
    + back 2.0 ms

read: headers to handler (body received, JSON decoded, fields validated); checks: the prompt checked
against the model and handed to the engine; engine: from the hand-over to the token's existence on
worker 0 (of which queued: until worker 0's scheduler took it up, prefill: the workers' own time, between:
the rest, the time between a chunked prompt's chunks, where the running requests decode and short prompts
go first, and the scheduler's host work);
back: from the token on worker 0 to the server's event loop, where its chunk is written.
"""
import re
import time
from dataclasses import dataclass

from burstserve.engine.core.outputs import PrefillStats

RECEIVED = "burstserve_received"   # the ASGI scope's state key the ReceiveClock middleware sets
# the request line's parts, as describe() writes them (ms); queued and prefill are there when the workers said
PARTS_PATTERN = re.compile(r"TTFT (?P<ttft>[\d.]+) ms = read (?P<read>[\d.]+) ms \+ checks (?P<checks>[\d.]+) ms "
                           r"\+ engine (?P<engine>[\d.]+) ms(?: \(queued (?P<queued>[\d.]+), prefill (?P<prefill>[\d.]+), "
                           r"between (?P<between>[\d.]+)\))?"
                           r" \+ back (?P<back>[\d.]+) ms")


class ReceiveClock:
    """ASGI middleware (outermost): notes when a request's headers arrived, before its body is read."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})[RECEIVED] = time.time()
        await self.app(scope, receive, send)


@dataclass
class Timeline:
    received: float            # headers arrived (the handler's start where no middleware noted it)
    parsed: float              # the handler started
    submitted: float = 0.0     # handed to the engine
    delivered: float = 0.0     # the first token reached the event loop

    @classmethod
    def start(cls, raw=None) -> "Timeline":
        """At a handler's start; `raw` is its starlette Request (None when called directly)."""
        now = time.time()
        received = (raw.scope.get("state") or {}).get(RECEIVED, now) if raw is not None else now
        return cls(received=min(received, now), parsed=now)

    def describe(self, token_time: float, prefill: PrefillStats | None) -> str:
        """The TTFT and its parts, in ms; `token_time` and `prefill` are the first token's."""
        ms = lambda seconds: f"{seconds * 1e3:.1f}"   # noqa: E731
        stats = prefill or PrefillStats()
        inside = ""
        if stats.queued_seconds is not None and stats.prefill_seconds is not None:
            between = max(0.0, token_time - self.submitted - stats.queued_seconds - stats.prefill_seconds)
            inside = f" (queued {ms(stats.queued_seconds)}, prefill {ms(stats.prefill_seconds)}, between {ms(between)})"
        return (f"TTFT {ms(self.delivered - self.received)} ms = read {ms(self.parsed - self.received)} ms + checks "
                f"{ms(self.submitted - self.parsed)} ms + engine {ms(token_time - self.submitted)} ms" + inside
                + f" + back {ms(self.delivered - token_time)} ms")

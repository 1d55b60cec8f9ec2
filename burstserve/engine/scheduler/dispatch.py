"""Worker 0's calls to the workers: run here at once, sent to the others one message a turn.

Worker 0 runs every call when the scheduler makes it (engine/worker.py run_call), work placed by the scheduler's
KV manager before (`KVManager.place`: where its new tokens go over the workers, on which pages). The other workers get
one Turn (engine/core/calls.py) a scheduler turn: the cache's changes worker 0 made since the last one (evictions,
copies of prefixes, retirements, frees), then the turn's work (a prefill, an extend, a decode step), which
they run in that order. No cache change is a collective, so worker 0 never waits on a worker that has not had
it yet; the work's collectives find every worker at the same call. A turn without work (a step read back, a
request refused) leaves its changes to the next message; `flush` sends them before the scheduler waits for
requests."""
from typing import Callable

from burstserve.engine.core.calls import CACHE_CHANGES, Shutdown, Turn


class Dispatch:
    def __init__(self, run_here: Callable, send: Callable | None):
        """run_here(call): runs it on worker 0 -> its result; send(Turn): to every other worker (None: none)."""
        self.run_here, self.send = run_here, send
        self.changes: list = []            # the cache's changes run here, not yet sent

    def __call__(self, call):
        """Runs the call here -> its result; work (anything but a cache change, placed already) is sent at once,
        with the changes before it."""
        if isinstance(call, CACHE_CHANGES):
            if self.send is not None:
                self.changes.append(call)
            return self.run_here(call)
        self._send(call)
        return None if isinstance(call, Shutdown) else self.run_here(call)

    def flush(self) -> None:
        """The changes not yet sent go out alone (the scheduler is about to wait)."""
        if self.changes:
            self._send(None)

    def _send(self, work) -> None:
        if self.send is not None:
            self.send(Turn(self.changes, work))
            self.changes = []

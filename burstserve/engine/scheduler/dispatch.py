"""Worker 0's calls to the workers: run here at once, sent to the others one message a turn; the only way the
scheduler's side reaches a worker.

Worker 0 runs every call when the scheduler makes it (its runner's one entry point, ModelRunner.execute), work
placed by the scheduler's KV manager while it planned the turn (`KVManager.place`: where its new tokens go over
the workers, on which pages), and reads its host tier's progress after each (engine/core/messages.py
HostProgress: what the scheduler's update hands the KV manager). The other workers get
one Turn (engine/core/calls.py) a scheduler turn: the cache's changes worker 0 made since the last one (evictions,
copies of prefixes, retirements, frees), then the turn's work (a prefill, an extend, a decode step), which
they run in that order. No cache change is a collective, so worker 0 never waits on a worker that has not had
it yet; the work's collectives find every worker at the same call. A turn without work (a step read back, a
request refused) leaves its changes to the next message; `flush` sends them before the scheduler waits for
requests."""
from typing import Callable

from burstserve.engine.core.calls import CACHE_CHANGES, Shutdown, Turn
from burstserve.engine.core.messages import HostProgress


class Dispatch:
    def __init__(self, run_here: Callable, send: Callable | None, host_progress: Callable | None = None):
        """run_here(call): runs it on worker 0 -> its result; send(Turn): to every other worker (None: none);
        host_progress(): worker 0's host tier's HostProgress after a call (None: no copies ever pending)."""
        self.run_here, self.send, self.host_progress = run_here, send, host_progress
        self.changes: list = []            # the cache's changes run here, not yet sent
        self.host = HostProgress()         # the host tier's progress after the last call run here

    def __call__(self, call):
        """Runs the call here -> its result; work (anything but a cache change, placed already) is sent at once,
        with the changes before it."""
        if isinstance(call, CACHE_CHANGES):
            if self.send is not None:
                self.changes.append(call)
            return self._run_here(call)
        self._send(call)
        return None if isinstance(call, Shutdown) else self._run_here(call)

    def _run_here(self, call):
        result = self.run_here(call)
        if self.host_progress is not None:
            self.host = self.host_progress()
        return result

    def flush(self) -> None:
        """The changes not yet sent go out alone (the scheduler is about to wait)."""
        if self.changes:
            self._send(None)

    def _send(self, work) -> None:
        if self.send is not None:
            self.send(Turn(self.changes, work))
            self.changes = []

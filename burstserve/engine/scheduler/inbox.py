"""The scheduler's inbox: the messages LLM sends worker 0's loop (engine/core/messages.py) taken into its state.

AddRequest joins the waiting queue, AbortRequest marks a request to drop, StopScheduler ends the loop. The
marked requests leave wherever they are (waiting, preempted, running, prefilling in chunks) with their
pages, between steps: never while a decode step is in flight (the scheduler drops them after it)."""
import queue
from collections import deque

from burstserve.engine.core.messages import AbortRequest, AddRequest, StopScheduler
from burstserve.engine.scheduler.sequences import SchedulerState


class Inbox:
    def __init__(self, requests: "queue.Queue", state: SchedulerState, kv):
        """requests: the queue LLM puts messages on; kv: the scheduler's KVManager (frees an aborted one's pages)."""
        self.requests, self.state, self.kv = requests, state, kv

    def take(self, block: bool) -> bool:
        """Takes every pending message (block: waits for the first) -> False on shutdown."""
        while True:
            try:
                msg = self.requests.get(timeout=0.5) if block else self.requests.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            if isinstance(msg, StopScheduler):
                return False
            if isinstance(msg, AddRequest):
                self.state.waiting.append(msg.request)
            elif isinstance(msg, AbortRequest):
                self.state.aborted.add(msg.request_id)

    def drop_aborted(self) -> None:
        """The marked requests leave the state; their pages (and a preempted one's kept entry) are freed."""
        s = self.state
        if not s.aborted:
            return
        s.waiting = deque(r for r in s.waiting if r.request_id not in s.aborted)
        for seq in [x for x in s.preempted if x.request.request_id in s.aborted]:
            if self.kv.kept(seq.seq_id):             # its pages, kept as an entry: freed as an abort's are
                self.kv.drop(seq.seq_id)
        s.preempted = deque(x for x in s.preempted if x.request.request_id not in s.aborted)
        gone = [x.seq_id for x in s.running if x.request.request_id in s.aborted]
        if gone:
            self.kv.free(gone)
            s.running = [x for x in s.running if x.request.request_id not in s.aborted]
        if s.prefilling is not None and s.prefilling.seq.request.request_id in s.aborted:
            self.kv.free([s.prefilling.seq.seq_id])
            s.prefilling = None
        s.aborted.clear()

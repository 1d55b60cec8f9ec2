"""Taking a sequence out when the KV cache is full (the scheduler carries out a Preempt or a GiveWay plan).

With the prefix cache a preempted sequence's pages stay as an entry of the tokens whose K/V exist, evicted
like any other; resumed, it takes back what is left of them and recomputes only the rest. Otherwise its pages
are freed and its prompt and generated tokens are prefilled again. A prompt still in chunks gives way to the
head of the queue (first come, first served). The counts feed the engine's stats (preemptions, tokens
prefilled again)."""
import logging
from collections import deque

from burstserve.engine.cache.kv_manager import KVManager
from burstserve.engine.scheduler.sequences import RunningSequence, SchedulerState

log = logging.getLogger(__name__)


class Preemptions:
    def __init__(self, state: SchedulerState, kv: KVManager):
        self.state, self.kv = state, kv
        self.count = 0                   # sequences preempted, prompts in chunks given way
        self.recomputed_tokens = 0       # prefilled again to resume (cache hits not): counted by the scheduler

    def newest(self, seq: RunningSequence) -> None:
        """A running sequence (the newest) out of the batch."""
        self.state.running.remove(seq)
        self.state.decode_owed = True
        self.preempt(seq)

    def give_way(self) -> None:
        """The prompt in chunks, the newest request, gives its pages back: a recompute goes back among the
        preempted (what it recomputed so far kept as its entry), a prompt to the head of the queue."""
        job, self.state.prefilling = self.state.prefilling, None
        self.state.decode_owed = True
        if job.resumed:
            self.preempt(job.seq, job.tokens[:job.done])
            return
        self.kv.free([job.seq.seq_id])
        self.state.waiting.appendleft(job.seq.request)
        self.count += 1
        log.info("request %s preempted (KV cache full) after %d of its %d prompt tokens; it will be prefilled again",
                 job.seq.request.request_id, job.done, len(job.tokens))

    def preempt(self, seq: RunningSequence, computed: list[int] | None = None) -> None:
        """Out of the batch; with the prefix cache its pages stay as an entry of the tokens whose K/V exist
        (`computed`; by default all but its last sampled token's), else (or with none) they are freed. The
        preempted wait in arrival order."""
        if computed is None:
            computed = seq.request.prompt_token_ids + seq.generated[:-1]
        if self.kv.prefix_cache is not None and computed:
            self.kv.retire(seq.seq_id, computed)
        else:
            self.kv.free([seq.seq_id])
        seq.preemptions += 1
        self.count += 1
        self.state.preempted = deque(sorted([*self.state.preempted, seq],
                                            key=lambda s: (s.request.arrival_time, s.seq_id)))
        log.info("request %s preempted (KV cache full) after %d tokens; it will be recomputed",
                 seq.request.request_id, len(seq.generated))

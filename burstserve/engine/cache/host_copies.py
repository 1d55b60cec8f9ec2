"""The host tier's copies still running, as the KV manager (engine/cache/kv_manager.py) knows them: worker 0's last
report (engine/core/messages.py HostProgress, handed over by the scheduler's update from a StepResult), and the
copies issued since. The KV manager plans with them: an entry still being stored is evicted last (freeing its
pages would wait for the copy), a prompt still restoring waits while others decode, and an idle engine issues
queued stores a slice a turn. None of this is a correctness rule: a worker waits for its own copies on its GPU."""
from dataclasses import replace

from burstserve.engine.core.messages import HostProgress


class HostCopies:
    def __init__(self):
        self.progress = HostProgress()

    def report(self, progress: HostProgress) -> None:
        """Worker 0's report after a turn's calls: it covers every copy issued before it."""
        self.progress = progress

    def issued(self, storing: int | None = None, loading: int | None = None) -> None:
        """A store of `storing` or a restore into `loading` just issued: running until a report says otherwise
        (where copies run beside compute; on CPU they are done when their call returns). A store is queued a
        layer at a time (engine/pages/host_pool.py), so an idle engine pumps it out until a report says none is."""
        p = self.progress
        if p.asynchronous and storing is not None:
            p = replace(p, storing=p.storing | {storing}, queued=max(p.queued, 1))
        if p.asynchronous and loading is not None:
            p = replace(p, loading=p.loading | {loading})
        self.progress = p

    def restoring(self, seq_id: int) -> bool:
        return seq_id in self.progress.loading

    def storing(self, seq_id: int) -> bool:
        return seq_id in self.progress.storing

    def stores_queued(self) -> bool:
        return self.progress.queued > 0

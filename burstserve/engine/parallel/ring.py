"""Ring communicator: K/V blocks travel to the next worker while the current block computes.

`exchange(send, recv)` starts sending `send` to rank+1 and receiving rank-1's block into `recv`;
`wait(handle)` makes the compute stream wait for it. On GPUs the transfer is issued on a separate
stream that first waits for all compute issued so far (so a buffer is never
overwritten while still being read); on CPU (gloo) the transfer runs on gloo's own threads. Each
exchange records how long it took as it ran and how long compute stalled waiting for it (the
exposed time). The share hidden is judged against the exchanges' time alone (see
engine/parallel/exchange_time.py), since overlap itself stretches a transfer.
"""
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class OverlapStats:
    exchange_seconds: float = 0.0   # time the transfers took, end to end, as they ran (stretched by overlap)
    exposed_seconds: float = 0.0    # time compute stood still waiting for them
    exchanges: int = 0


@dataclass
class _Handle:
    works: list
    issued_at: float = 0.0
    events: tuple = ()     # (start, end) on the comm stream
    stall: tuple = ()      # (before, after) the compute stream's wait


class RingCommunicator:
    def __init__(self, rank: int, world_size: int, device: torch.device, group=None):
        self.rank, self.world_size, self.device, self.group = rank, world_size, device, group
        self.next_rank = (rank + 1) % world_size
        self.prev_rank = (rank - 1) % world_size
        self.is_cuda = device.type == "cuda"
        # Normal priority: a high-priority side stream measured worse (docs/design.md, "ring.py").
        self.comm_stream = torch.cuda.Stream(device=device) if self.is_cuda else None
        self._pending_timings: list[_Handle] = []
        self.stats = OverlapStats()
        self._warm_up()

    def _warm_up(self) -> None:
        """One small exchange, waited on the host: NCCL creates its peer-to-peer communicator on the
        first send/recv, and the first prefill's time to first token should not pay for that."""
        send = torch.zeros(1024, device=self.device)
        recv = torch.empty_like(send)
        self.wait(self.exchange(send, recv))
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        self._pending_timings.clear()
        self.stats = OverlapStats()

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> _Handle:
        """Sends `send` to the next rank, receives the previous rank's block into `recv` (async)."""
        ops = []   # an empty block (a worker with no tokens) is skipped on both sides alike
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, self._global(self.next_rank), self.group))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, self._global(self.prev_rank), self.group))
        if not ops:
            return _Handle([], issued_at=time.perf_counter())
        if not self.is_cuda:
            return _Handle(dist.batch_isend_irecv(ops), issued_at=time.perf_counter())
        compute = torch.cuda.current_stream(self.device)
        self.comm_stream.wait_stream(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.comm_stream):
            start.record()
            works = dist.batch_isend_irecv(ops)
            for w in works:
                w.wait()
            end.record()
        return _Handle(works, events=(start, end))

    def wait(self, handle: _Handle) -> None:
        """The compute stream (or the host, on CPU) waits until the exchange is complete."""
        if not handle.works:
            return
        if not self.is_cuda:
            before = time.perf_counter()
            for w in handle.works:
                w.wait()
            after = time.perf_counter()
            self.stats.exchange_seconds += after - handle.issued_at
            self.stats.exposed_seconds += after - before
            self.stats.exchanges += 1
            return
        compute = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(handle.events[1])
        after.record(compute)
        handle.stall = (before, after)
        self._pending_timings.append(handle)

    def collect_stats(self) -> OverlapStats:
        """Synchronizes, folds the recorded GPU timings into `stats` and returns them (then resets)."""
        if self.is_cuda and self._pending_timings:
            torch.cuda.synchronize(self.device)
            for h in self._pending_timings:
                self.stats.exchange_seconds += h.events[0].elapsed_time(h.events[1]) / 1e3
                self.stats.exposed_seconds += h.stall[0].elapsed_time(h.stall[1]) / 1e3
                self.stats.exchanges += 1
            self._pending_timings.clear()
        stats, self.stats = self.stats, OverlapStats()
        return stats

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


class RingPass:
    """Sends one block per worker around the whole ring: `run(local, compute, between)` calls
    compute(source_rank, block) for every worker's block, own first, while the next block is
    already in flight into the other of two buffers (unless overlap is off). Block sizes follow
    `lengths` (tokens per worker), known to every worker; the trailing shape is the local block's.

    `between()` (optional) is work of the caller's that needs no block, queued after the first exchange
    and before the first compute: the layer's K/V store. On a GPU the exchange's kernel waits on another
    stream for the block it sends; with nothing queued between, it becomes ready at the same moment as the
    attention after it, the GPU hands out the attention's whole grid first, and the exchange runs after the
    attention instead of beside it. A kernel of some length in between lets the exchange's kernel start
    first (a one-element kernel is too short: docs/design.md, "ring.py"). The later steps' exchanges get the
    previous step's merge there (BurstAttention.forward)."""

    def __init__(self, ring: RingCommunicator | None, lengths: list[int], rank: int, overlap: bool = True):
        self.ring, self.lengths, self.rank, self.overlap = ring, lengths, rank, overlap
        self.world_size = len(lengths)
        self._buffers: dict[tuple, list[torch.Tensor]] = {}

    def run(self, local: torch.Tensor, compute, between=None) -> None:
        current = local
        for step in range(self.world_size):
            source = (self.rank - step) % self.world_size
            handle, incoming = None, None
            if step + 1 < self.world_size:
                incoming = self._buffer(step % 2, (self.rank - step - 1) % self.world_size, local)
                handle = self.ring.exchange(current, incoming)
                if not self.overlap:
                    self.ring.wait(handle)
            if step == 0 and between is not None:
                between()
            compute(source, current)
            if handle is not None and self.overlap:
                self.ring.wait(handle)
            current = incoming

    def _buffer(self, slot: int, source: int, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape[1:]), like.dtype)
        if key not in self._buffers:
            shape = (max(self.lengths),) + key[0]
            self._buffers[key] = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(2)]
        return self._buffers[key][slot][:self.lengths[source]]

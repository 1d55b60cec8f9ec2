"""One worker's host-memory tier under the prefix cache (--kv-offload-gb): pages like its GPU pool's
(engine/pages/page_pool.py), in host memory, pinned on CUDA workers so that copies run as DMA beside compute.

    tensors: one per PagePool tensor (k, v; with FP8 pages also k_scale, v_scale),
             [num_layers, num_pages, block_size, ...] like the pool's, without its scratch page

An entry (`pages[host_id]`, host_id the id of the sequence it was copied from) holds a prefix of that
sequence's slots on this worker, as whole pages in token order. `store` copies a GPU sequence's first pages
in (the scheduler does it when a sequence retires into a prefix-cache entry: write-through, so dropping the
GPU copy later costs no copy); `load` copies an entry's first pages into a new sequence's GPU pages (a
restore). Every page is copied whole, so a restored page past the entry's last slot holds finite K/V as the
GPU pool's own pages do.

Order on CUDA: stores run on one side stream and loads on another (a restore does not queue behind a
large store of another entry). Each first waits for the compute stream (the K/V a store copies out are
written; the pages a load fills are no longer read). A store is queued a layer at a time and issued by
`pump`, at most STORE_IN_FLIGHT bytes ahead around each call of the worker (an idle engine sends calls for
it): the copy engine serves one direction's copies in order, so a call's small readback waits behind at most
that much. A load of an entry waits for that entry's store; a store waits for the loads out of host pages
freed since (it may take them). The compute stream waits for a load before it runs the restored sequence:
layer by layer when it runs at once (`layer_waits`), else the scheduler lets the running sequences decode
until `progress` says its restore is done; and for both before the GPU pages they touch are freed or truncated
(`pages_unused`). On CPU the copies are plain and synchronous.
"""
import contextlib
import time
from collections import deque

import torch

from burstserve.engine.cache.ledger import pages_for
from burstserve.engine.core.errors import DeviceSpecError
from burstserve.engine.core.messages import HostProgress
from burstserve.engine.pages.page_pool import HeldPages, OutOfPagesError, PagePool, page_runs


DIRECT_RUNS = 16          # a copy of more runs of GPU pages goes through a staging buffer (HostPool._copy)
STORE_IN_FLIGHT = 256 << 20   # store bytes issued ahead at a call (~5 ms of the link): what a call's own
                              # readback may wait behind
STAGE_BYTES = 64 << 20    # the largest staging block


class HostMemoryError(DeviceSpecError):
    """The host tier's memory could not be allocated or pinned."""


def pin(t: torch.Tensor) -> None:
    """Page-locks t's memory in place (cudaHostRegister: exactly its bytes, unlike torch's pinned allocator,
    which rounds a block up to a power of two)."""
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    if rc != 0:
        raise HostMemoryError(f"pinning {t.numel() * t.element_size() / 2**30:.1f} GiB of host memory for the KV "
                              f"host tier failed (cudaHostRegister returned CUDA error {rc}): lower --kv-offload-gb")


def unpin(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class HostPool:
    def __init__(self, gpu: PagePool, num_pages: int, direct_runs: int = DIRECT_RUNS, placed: bool = False):
        """Host pages shaped like the GPU pool's; num_pages per worker (the same on every worker); direct_runs:
        the most runs of GPU pages copied run by run (more go through a staging buffer); placed: the KV
        manager names the pages of every store (engine/pages/page_pool.py HeldPages)."""
        self.num_pages, self.block_size, self.direct_runs = num_pages, gpu.block_size, direct_runs
        self.cuda = gpu.device.type == "cuda"
        self.tensors = [torch.empty((t.shape[0], num_pages, *t.shape[2:]), dtype=t.dtype) for t in gpu._tensors()]
        self.pinned = []
        if self.cuda:
            for t in self.tensors:
                pin(t)
                self.pinned.append(t)
            self.store_stream, self.load_stream = torch.cuda.Stream(gpu.device), torch.cuda.Stream(gpu.device)
        self.page_bytes = sum(t[0, 0].numel() * t.element_size() for t in self.tensors) * gpu.k.shape[0]
        self.held = HeldPages(0, num_pages, placed)        # host page ids 0 .. num_pages - 1
        self.pages: dict[int, list[int]] = {}             # host_id -> its host pages, in token order
        self.stored: dict[int, torch.cuda.Event] = {}     # GPU seq_id -> its latest store's end (CUDA)
        self.written: dict[int, torch.cuda.Event] = {}    # host_id -> its store's end (CUDA)
        self.read: dict[int, torch.cuda.Event] = {}       # host_id -> its latest load's end (CUDA)
        self.freed_reads: list[torch.cuda.Event] = []     # loads out of host pages freed since the last store
        self.queued: deque = deque()                      # store layers not issued yet (CUDA; `pump`)
        self.in_flight: deque = deque()                   # (end event, bytes) of store layers issued
        self.in_flight_bytes = 0
        self.storing: dict[int, int] = {}                 # GPU seq_id -> host_id of a store still queued
        self.storing_hosts: dict[int, int] = {}           # ... and the other way
        self.loads: dict[int, tuple] = {}                 # GPU seq_id -> (start, end, bytes) of its restore
        self.layers_loaded: dict[int, list] = {}          # GPU seq_id -> each layer's end of its restore (CUDA)

    @property
    def free_pages(self) -> int:
        return self.held.free

    def bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def store(self, gpu: PagePool, seq_id: int, host_id: int, num_tokens: int,
              pages: list[int] | None = None) -> int:
        """A new entry host_id (on `pages` where placed): a copy of the GPU sequence's first num_tokens slots ->
        bytes copied. On CUDA
        the copy is queued a layer at a time and issued by `pump`: the GPU's copy engine for this direction
        serves its copies in order, so a 16 GiB store issued at once would hold a decode step's 16-byte
        token readback for its 0.3 s (measured)."""
        n = pages_for(num_tokens, self.block_size)
        if n > self.held.free:
            raise OutOfPagesError(f"host entry {host_id} needs {n} pages, {self.held.free} are free")
        self.pages[host_id] = host_pages = self.held.take(f"host entry {host_id}", n, pages)
        dev_pages = gpu.pages[seq_id][:n]
        if not self.cuda:
            self._copy(gpu, host_pages, dev_pages, out=True)
            return n * self.page_bytes
        ready = self._record(torch.cuda.current_stream())             # its K/V are written
        layers = self.tensors[0].shape[0]
        for layer in range(layers):
            last = (seq_id, host_id) if layer == layers - 1 else None
            self.queued.append((ready, gpu, host_pages, dev_pages, layer, n * self.page_bytes // layers, last))
        self.storing[seq_id], self.storing_hosts[host_id] = host_id, seq_id
        return n * self.page_bytes

    def pump(self, limit: int | None = None, until: int | None = None) -> None:
        """Issues queued store layers while fewer than `limit` bytes are in flight (None: every one), or with
        `until` (a GPU seq_id) up to that sequence's store's last layer, the ones queued before it first."""
        while self.in_flight and self.in_flight[0][0].query():
            self.in_flight_bytes -= self.in_flight.popleft()[1]
        if until is not None and until not in self.storing:
            return
        while self.queued and (until is not None or limit is None or self.in_flight_bytes < limit):
            ready, gpu, host_pages, dev_pages, layer, nbytes, last = self.queued.popleft()
            with self._on(self.store_stream, [ready] + self.freed_reads):
                self._copy(gpu, host_pages, dev_pages, out=True, layers=[layer])
            self.freed_reads = []
            event = self._record(self.store_stream)
            self.in_flight.append((event, nbytes))
            self.in_flight_bytes += nbytes
            if last is not None:
                seq_id, host_id = last
                self.stored[seq_id] = self.written[host_id] = event
                self.storing.pop(seq_id, None)
                self.storing_hosts.pop(host_id, None)
                if seq_id == until:
                    return

    def load(self, gpu: PagePool, host_id: int, seq_id: int, num_tokens: int) -> int:
        """The GPU sequence's first num_tokens slots (its pages already taken) <- the entry's -> bytes copied."""
        n = pages_for(num_tokens, self.block_size)
        start = time.perf_counter()
        if host_id in self.storing_hosts:                             # its store still queued: issued now
            self.pump(until=self.storing_hosts[host_id])
        written = [self.written[host_id]] if host_id in self.written else []
        with self._on(self.load_stream if self.cuda else None, written):
            begun = self._record(self.load_stream) if self.cuda else None
            layers = self._copy(gpu, self.pages[host_id][:n], gpu.pages[seq_id][:n], out=False)
        ended = layers[-1] if self.cuda else time.perf_counter() - start
        if self.cuda:
            self.read[host_id] = ended
            self.layers_loaded[seq_id] = layers
        self.loads[seq_id] = (begun, ended, n * self.page_bytes)
        return n * self.page_bytes

    def _copy(self, gpu: PagePool, host_pages: list[int], dev_pages: list[int], out: bool,
              layers: list[int] | None = None) -> list:
        """Every tensor's pages host_pages[i] <-> dev_pages[i] (out: GPU to host), layer by layer: one DMA a run
        where both sides go up one by one; where the GPU's pages are scattered (more than `direct_runs` runs),
        one DMA a run of host pages through a staging buffer on the GPU (gathered before, scattered after), as
        small copies run far below the link's rate (a page of FP8 scales is 32 KiB) -> on CUDA an event after
        each layer's copies (on the current stream), else []. layers: only these layers (default: all)."""
        runs = page_runs(dev_pages, host_pages)
        staged = len(runs) > self.direct_runs
        index = torch.tensor(dev_pages, dtype=torch.long).to(gpu.device, non_blocking=True) if staged else None
        events = []
        for layer in range(self.tensors[0].shape[0]) if layers is None else layers:
            for host, dev in zip(self.tensors, gpu._tensors()):
                if staged:
                    self._staged(host[layer], dev[layer], host_pages, index, out)
                    continue
                for d, h, length in runs:
                    if out:
                        host[layer, h:h + length].copy_(dev[layer, d:d + length], non_blocking=self.cuda)
                    else:
                        dev[layer, d:d + length].copy_(host[layer, h:h + length], non_blocking=self.cuda)
            if self.cuda:
                events.append(self._record(torch.cuda.current_stream()))
        return events

    def _staged(self, host: torch.Tensor, dev: torch.Tensor, host_pages: list[int], index: torch.Tensor,
                out: bool) -> None:
        """One layer's pages through a staging buffer: host [pages, ...], dev [pages + 1, ...]; index [n] the
        GPU pages of host_pages, on the device. A staged block is at most STAGE_BYTES."""
        step = max(1, STAGE_BYTES // (dev[0].numel() * dev.element_size()))
        start = 0
        while start < len(host_pages):
            end = start + 1
            while end < len(host_pages) and end - start < step and host_pages[end] == host_pages[end - 1] + 1:
                end += 1
            h = host_pages[start]
            if out:
                host[h:h + end - start].copy_(dev.index_select(0, index[start:end]), non_blocking=self.cuda)
            else:
                dev.index_copy_(0, index[start:end], host[h:h + end - start].to(dev.device, non_blocking=self.cuda))
            start = end

    def progress(self) -> HostProgress:
        """The copies still running (CPU: none): what worker 0 reports to the KV manager after every call. A
        store seen done is forgotten (freeing its pages waits for nothing), so each report asks only the copies
        in flight."""
        if not self.cuda:
            return HostProgress()
        for seq_id in [s for s, event in self.stored.items() if event.query()]:
            del self.stored[seq_id]
        loading = frozenset(s for s, load in self.loads.items() if not load[1].query())
        return HostProgress(True, loading, frozenset(self.storing) | frozenset(self.stored), len(self.queued))

    def pages_unused(self, seq_id: int) -> None:
        """Before the GPU sequence's pages go back to the pool (whoever takes them next writes them): the compute
        stream waits for the tier's copies out of them (`wait_stored`) and into them (a restore never run), and
        the restore is forgotten."""
        self.wait_stored(seq_id)
        load = self.loads.pop(seq_id, None)
        self.layers_loaded.pop(seq_id, None)
        if load is not None and self.cuda:
            torch.cuda.current_stream().wait_event(load[1])

    def layer_waits(self, seq_id: int) -> "list | None":
        """The events after each layer's copies of the sequence's pending restore (CUDA), given once: an extend
        waits for layer i's before its layer i reads the cache, so the copy of later layers hides under the
        compute of earlier ones. None: no restore pending."""
        return self.layers_loaded.pop(seq_id, None)

    def restore_seconds(self, seq_id: int) -> "tuple[float, int] | None":
        """(seconds, bytes) of the sequence's restore, once it is done (read after a synchronize); forgets it."""
        load = self.loads.pop(seq_id, None)
        if load is None:
            return None
        begun, ended, nbytes = load
        return (begun.elapsed_time(ended) / 1e3 if self.cuda else ended), nbytes

    def wait_stored(self, seq_id: int) -> None:
        """The compute stream waits for the latest store out of the sequence's GPU pages before they are
        freed or truncated (they would be written by whoever takes them next)."""
        self.pump(until=seq_id)                                       # still queued: issued now
        event = self.stored.pop(seq_id, None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def free(self, host_id: int) -> None:
        """The entry's pages go back (the next store waits for the loads out of them; its own store, if still
        queued, is issued first: its events are what a later entry of the same id would wait for)."""
        if host_id in self.storing_hosts:
            self.pump(until=self.storing_hosts[host_id])
        pages = self.pages.pop(host_id, None)
        if pages is not None:
            self.held.release(pages)
        self.written.pop(host_id, None)
        read = self.read.pop(host_id, None)
        if read is not None:
            self.freed_reads.append(read)

    def release(self) -> None:
        """Unpins the tier's memory (at shutdown: the kernel unpinning it at exit can stall for seconds)."""
        if self.cuda:
            self.pump()
            torch.cuda.synchronize()
        for t in self.pinned:
            unpin(t)
        self.pinned = []

    @staticmethod
    def _record(stream) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    @staticmethod
    def _on(stream, after: list):
        """On CUDA: the side stream, after the compute stream's work so far and the events `after`; on CPU
        (stream None): nothing."""
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream())
        for event in after:
            stream.wait_event(event)
        return torch.cuda.stream(stream)


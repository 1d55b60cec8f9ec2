"""One worker's KV cache: a pool of pages allocated once at start, and each sequence's page list.

    k, v [num_layers, num_pages + 1, block_size, Hkv, D]; `layer(i)` gives layer i's caches as
    kernels.paged_attention reads them ([num_blocks, block_size, Hkv, D], contiguous).
    With kv_cache_dtype fp8 (kernels/kv_quant.py) k and v hold float8_e4m3fn bits (uint8) and
    k_scale, v_scale [num_layers, num_pages + 1, block_size, Hkv] bf16 their per-(token, head) scales:
    `layer(i)` then gives two kv_quant.Fp8Pages, and `write` quantizes what it stores.

Page 0 is scratch: it is never given to a sequence, and a decode step writes there the new K/V of
sequences whose token another worker stores (so every step writes B rows, with fixed shapes for
CUDA graphs). A sequence's tokens fill its pages in order; slot = page * block_size + offset.
Which pages: in the engine (`placed=True`) the KV manager's ledger picks them (engine/cache/ledger.py) and
every call that grows a sequence names them, checked here to be free; a pool alone (tests, tools) takes them
from its own free stack, lowest ids first.
Each sequence also has a row of `table` ([max_seqs + 1, max_pages] int32, on the device): its page
ids, which a step gathers into its block table without building it on the host; the last row is
never given out (all scratch: the padding rows of a CUDA graph's batch).
"""
import torch

from burstserve.engine.cache.ledger import pages_for
from burstserve.engine.core.devices import host_to_device
from burstserve.kernels.fused import store_kv
from burstserve.kernels.kv_quant import SCALE_DTYPE, Fp8Pages, is_fp8, store_kv_fp8

COPY_BYTES = 1 << 28        # the largest temporary a prefix copy makes (it gathers pages, then scatters them)
MAX_RUN_COPIES = 64         # a prefix copy in at most this many runs of consecutive pages copies run by run
LAYERWISE_RUNS = 4          # ... and in at most this many, layer by layer (contiguous copies; more calls)


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, pages) of the maximal runs in which both page lists
    go up one by one (a prompt's pages mostly come off the free stack in order)."""
    runs = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class OutOfPagesError(RuntimeError):
    """The scheduler asked for more pages than are free (its ledger and the pool disagree: a bug)."""


class HeldPages:
    """Which of a pool's page ids (first .. first + count - 1) sequences hold. Placed (the engine's pools): the
    KV manager's ledger names every page a sequence takes, checked here to be free; else (a pool alone: tests,
    tools) the pool takes them off its own free stack, lowest ids first so that a prompt's pages are runs."""

    def __init__(self, first: int, count: int, placed: bool):
        self.first, self.count, self.placed = first, count, placed
        self._stack = None if placed else list(range(first + count - 1, first - 1, -1))
        self._in_use = bytearray(first + count)      # by page id
        self._used = 0

    @property
    def free(self) -> int:
        return self.count - self._used

    def take(self, what: str, need: int, given: list[int] | None) -> list[int]:
        """`need` more pages for `what`, marked held -> them: the given ones (placed) or the stack's lowest."""
        if self.placed:
            bad = given is None or len(given) != need or any(
                not self.first <= p < self.first + self.count or self._in_use[p] for p in given)
            if bad:
                raise OutOfPagesError(f"{what} needs {need} new pages; the call gave {given} (the KV manager's "
                                      f"ledger and this pool disagree: a bug)")
            new = list(given)
        else:
            if given is not None:
                raise ValueError("pages are given only to a placed pool")
            new = [self._stack.pop() for _ in range(need)]
        for p in new:
            self._in_use[p] = 1
        self._used += len(new)
        return new

    def release(self, pages: list[int]) -> None:
        """These pages are free again (on top of the free stack, in order, where the pool keeps one)."""
        for p in pages:
            self._in_use[p] = 0
        self._used -= len(pages)
        if self._stack is not None:
            self._stack.extend(reversed(pages))


class PagePool:
    def __init__(self, num_layers: int, num_pages: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, max_seqs: int, max_pages_per_seq: int,
                 kv_cache_dtype: str = "auto", placed: bool = False):
        shape = (num_layers, num_pages + 1, block_size, num_kv_heads, head_dim)
        # zeros on GPUs: flash-attn-4 reads whole pages, so the slots past a sequence's end must be finite;
        # empty on CPU: the reference reads only the slots in use, and untouched memory costs nothing
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.fp8 = is_fp8(kv_cache_dtype)
        stored = torch.uint8 if self.fp8 else dtype
        self.k = alloc(shape, dtype=stored, device=device)
        self.v = alloc(shape, dtype=stored, device=device)
        self.k_scale = alloc(shape[:-1], dtype=SCALE_DTYPE, device=device) if self.fp8 else None
        self.v_scale = alloc(shape[:-1], dtype=SCALE_DTYPE, device=device) if self.fp8 else None
        self.block_size, self.num_pages, self.device = block_size, num_pages, device
        self.max_pages_per_seq = max_pages_per_seq
        self.table = torch.zeros(max_seqs + 1, max_pages_per_seq, dtype=torch.int32, device=device)
        self.pad_row = max_seqs                     # never given out: all scratch (a graph's padding rows)
        self.held = HeldPages(1, num_pages, placed)  # pages 1..num_pages (0: scratch)
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self.pages: dict[int, list[int]] = {}       # seq_id -> its pages, in token order
        self.lengths: dict[int, int] = {}           # seq_id -> tokens stored
        self.rows: dict[int, int] = {}              # seq_id -> its row of `table`

    @property
    def free_pages(self) -> int:
        return self.held.free

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed [layer, page, ...]: what a page copy copies."""
        return [self.k, self.v] + ([self.k_scale, self.v_scale] if self.fp8 else [])

    def layer(self, i: int):
        """Layer i's (k_cache, v_cache) for kernels.paged_attention: [num_blocks, block_size, Hkv, D] tensors,
        or two Fp8Pages."""
        if self.fp8:
            return Fp8Pages(self.k[i], self.k_scale[i]), Fp8Pages(self.v[i], self.v_scale[i])
        return self.k[i], self.v[i]

    def add(self, seq_id: int, num_tokens: int, pages: list[int] | None = None) -> None:
        """A new sequence with room for num_tokens (its pages taken now, `pages` where placed; the slots are
        written later)."""
        if not self._free_rows:
            raise OutOfPagesError("no free row in the page table")
        self.pages[seq_id], self.lengths[seq_id] = [], 0
        self.rows[seq_id] = self._free_rows.pop()
        try:
            self._grow(seq_id, num_tokens, pages)
        except OutOfPagesError:
            self.free(seq_id)                    # nothing of it kept
            raise
        self.lengths[seq_id] = num_tokens

    def append(self, seq_id: int, page: int = 0) -> int:
        """Room for one more token (on `page` where it needs a new one and the pool is placed) -> its slot."""
        n = self.lengths[seq_id]
        if page or n == len(self.pages[seq_id]) * self.block_size:   # a new page (named, or one it needs)
            self._grow(seq_id, n + 1, ([page] if page else []) if self.held.placed else None)
        self.lengths[seq_id] = n + 1
        return self.slot(seq_id, n)

    def extend(self, seq_id: int, count: int, pages: list[int] | None = None) -> torch.Tensor:
        """Room for count more tokens (on `pages` beyond its own, where placed) -> their slots [count] int64 on
        the host (a CUDA graph copies them in with its other inputs; an eager extend moves them to the device)."""
        n = self.lengths[seq_id]
        self._grow(seq_id, n + count, pages)
        self.lengths[seq_id] = n + count
        return self.host_slots(seq_id, n, count)

    def slot(self, seq_id: int, index: int) -> int:
        return self.pages[seq_id][index // self.block_size] * self.block_size + index % self.block_size

    def slots(self, seq_id: int, start: int, count: int) -> torch.Tensor:
        """[count] int64 slots of the sequence's tokens start .. start + count - 1, on the device."""
        return self.host_slots(seq_id, start, count).to(self.device)

    def host_slots(self, seq_id: int, start: int, count: int) -> torch.Tensor:
        """slots(), on the host."""
        index = torch.arange(start, start + count)
        pages = torch.tensor(self.pages[seq_id], dtype=torch.int64)
        return pages[index // self.block_size] * self.block_size + index % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, Hkv, D] into slots [n] of one layer (one kernel on GPUs)."""
        if not self.fp8:
            store_kv(self.k[layer], self.v[layer], slots, k, v)
            return
        store_kv_fp8(self.k[layer], self.k_scale[layer], self.v[layer], self.v_scale[layer], slots, k, v)

    def copy_prefix(self, source_id: int, seq_id: int, num_tokens: int, pages: list[int] | None = None) -> None:
        """A new sequence (on `pages`, where placed) whose first num_tokens slots are a copy of the source's
        (whole pages, every layer)."""
        self.add(seq_id, num_tokens, pages)
        n = len(self.pages[seq_id])
        if n == 0:                       # this worker holds none of the prompt (fewer tokens than workers)
            return
        src, dst = self.pages[source_id][:n], self.pages[seq_id]
        runs = page_runs(src, dst)
        if len(runs) <= LAYERWISE_RUNS:        # a contiguous copy per run and layer: on GPUs about twice as fast
            for s, d, length in runs:          # as the strided copy below (measured)
                for cache in self._tensors():
                    for layer in cache:
                        layer[d:d + length].copy_(layer[s:s + length])
            return
        if len(runs) <= MAX_RUN_COPIES:        # a slice copy per run, every layer at once: one read, one write
            for s, d, length in runs:
                for cache in self._tensors():
                    cache[:, d:d + length] = cache[:, s:s + length]
            return
        src = torch.tensor(src, dtype=torch.long, device=self.device)
        dst = torch.tensor(dst, dtype=torch.long, device=self.device)
        page_bytes = self.k[0, 0].numel() * self.k.element_size()
        step = max(1, COPY_BYTES // page_bytes)    # a layer's pages at a time, a bounded batch of them: a 1M-token
        for cache in self._tensors():              # prefix would otherwise gather 64 GB at once
            for layer in cache:
                for i in range(0, n, step):
                    layer[dst[i:i + step]] = layer[src[i:i + step]]

    def retire(self, seq_id: int) -> None:
        """The sequence stops decoding but keeps its pages (a prefix-cache entry): its table row is given back."""
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.table[row].zero_()
            self._free_rows.append(row)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """A retired sequence keeps its first num_tokens slots; the pages after them go back to the pool."""
        pages = self.pages[seq_id]
        keep = pages_for(num_tokens, self.block_size)
        self.held.release(pages[keep:])
        del pages[keep:]
        self.lengths[seq_id] = num_tokens

    def reinstate(self, seq_id: int) -> None:
        """A retired sequence decodes again on the pages it kept: a table row, filled with them."""
        if not self._free_rows:
            raise OutOfPagesError("no free row in the page table")
        row = self.rows[seq_id] = self._free_rows.pop()
        pages = self.pages[seq_id]
        if pages:
            self.table[row, :len(pages)] = host_to_device(torch.tensor(pages, dtype=torch.int32), self.device)

    def free(self, seq_id: int) -> None:
        pages = self.pages.pop(seq_id, None)
        if pages is None:
            return
        self.held.release(pages)
        self.lengths.pop(seq_id)
        self.retire(seq_id)

    def _grow(self, seq_id: int, num_tokens: int, given: list[int] | None = None) -> None:
        """The sequence's pages cover num_tokens: the new ones are `given` (a placed pool: exactly those it
        needs, each free), or taken off the free stack."""
        pages = self.pages[seq_id]
        need = max(0, pages_for(num_tokens, self.block_size) - len(pages))
        if need > self.free_pages:
            raise OutOfPagesError(f"sequence {seq_id} needs {need} more pages, {self.free_pages} are free")
        if len(pages) + need > self.max_pages_per_seq:
            raise OutOfPagesError(f"sequence {seq_id} would hold more than {self.max_pages_per_seq} pages")
        new = self.held.take(f"sequence {seq_id}", need, given)
        if not new:
            return
        row, start = self.rows[seq_id], len(pages)
        # no wait for the device: a decode step grows sequences while the one before it may still run
        self.table[row, start:start + need] = host_to_device(torch.tensor(new, dtype=torch.int32), self.device)
        pages.extend(new)

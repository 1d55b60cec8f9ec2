"""BurstAttention prefill (forward only) over zigzag shards.

Queries stay on their worker; K and V travel together (one [n, 2, Hkv, D] block) around the ring.
At each of the G steps a worker attends its queries to the block it holds with one local kernel
call returning (out, lse), merges into fp32 accumulators, and meanwhile the next block is already
in flight into the other of two buffers. With zigzag shards (worker r holds chunks r and 2G-1-r)
each step is one of:
  own block:          causal attention of all local queries to all local keys (square);
  block of rank s<r:  all local queries to the keys of s's first chunk (full);
  block of rank s>r:  the queries of r's second chunk to all of s's keys (full).
Without a causal mask (causal=False) every step is all local queries to the whole block.
"""
import time

import torch

from engine.ring import RingCommunicator
from engine.sharding import Shard
from kernels.attention import AttentionBackend
from kernels.merge import merge_into


class BurstAttention:
    def __init__(self, ring: RingCommunicator | None, backend: AttentionBackend, shards: list[Shard],
                 rank: int, scale: float, overlap: bool = True, causal: bool = True):
        self.ring, self.backend, self.shards = ring, backend, shards
        self.rank, self.world_size = rank, len(shards)
        self.scale, self.overlap, self.causal = scale, overlap, causal
        self._buffers: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q [n, H, D], kv [n, 2, Hkv, D] (this worker's block) -> out [n, H, D] in q's dtype."""
        return self.forward(q, kv)[0]

    def forward(self, q: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> out [n, H, D] in q's dtype, lse [n, H] fp32."""
        out = lse = None
        current = kv
        for step in range(self.world_size):
            source = (self.rank - step) % self.world_size
            handle, incoming = None, None
            if step + 1 < self.world_size:
                incoming = self._buffer(step % 2, (self.rank - step - 1) % self.world_size, kv)
                handle = self.ring.exchange(current, incoming)
                if not self.overlap:
                    self.ring.wait(handle)
            out, lse = self._attend_block(q, current, source, out, lse)
            if handle is not None and self.overlap:
                self.ring.wait(handle)
            current = incoming
        return out.to(q.dtype), lse

    def time_exchanges_alone(self, block_shape: tuple, dtype: torch.dtype, device: torch.device,
                             rounds: int = 3) -> float:
        """Seconds one layer's G-1 exchanges take with nothing else running (best of `rounds`, after
        an untimed round that allocates the buffers): the yardstick for how much of them overlap
        hides. Collective: every worker calls it at the same point."""
        local = torch.empty((self.shards[self.rank].length,) + tuple(block_shape), dtype=dtype, device=device)
        best = float("inf")
        for round_ in range(rounds + 1):
            _synchronize(device)
            start = time.perf_counter()
            current = local
            for step in range(self.world_size - 1):
                incoming = self._buffer(step % 2, (self.rank - step - 1) % self.world_size, local)
                self.ring.wait(self.ring.exchange(current, incoming))
                current = incoming
            _synchronize(device)
            if round_ > 0:
                best = min(best, time.perf_counter() - start)
        self.ring.collect_stats()   # not part of the prefill's own figures
        return best

    def _buffer(self, slot: int, source: int, like: torch.Tensor) -> torch.Tensor:
        longest = max(s.length for s in self.shards)
        while len(self._buffers) < 2:
            self._buffers.append(torch.empty((longest,) + like.shape[1:], dtype=like.dtype, device=like.device))
        return self._buffers[slot][:self.shards[source].length]

    def _attend_block(self, q, block, source, out, lse):
        k, v = block[:, 0], block[:, 1]                                  # [m, Hkv, D] each
        if not self.causal:
            rows, block_out, block_lse = slice(None), *self.backend(q, k, v, False, self.scale)
        elif source == self.rank:
            rows, block_out, block_lse = slice(None), *self.backend(q, k, v, True, self.scale)
        elif source < self.rank:
            m = self.shards[source].len_first
            rows, block_out, block_lse = slice(None), *self.backend(q, k[:m], v[:m], False, self.scale)
        else:
            m = self.shards[self.rank].len_first
            rows, block_out, block_lse = slice(m, None), *self.backend(q[m:], k, v, False, self.scale)
        if out is None:   # the first step (own block) covers every query row
            return block_out.float(), block_lse.clone()
        merge_into(out[rows], lse[rows], block_out, block_lse)
        return out, lse


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""How long a prefill's ring exchanges take with nothing else running: the yardstick against which
`hidden_fraction` says how much of them compute hid (a transfer that overlaps compute is itself
stretched, so its own duration cannot be the yardstick).

Timed once, at worker start: two ring passes of K/V blocks (a small and a large one, best of 3
after an untimed one), fitted per ring step as latency + bytes / bandwidth. A prompt's figure is
then arithmetic: (G - 1) steps of its largest block, times the layers. Timing each new prompt
length on the request's path, as the engine did first, charged every served request a few ring
passes before its prefill (a new length is the rule when serving, and the benchmark, repeating one
length, never saw it).
"""
import time
from dataclasses import dataclass

import torch

from burstserve.engine.core.devices import synchronize
from burstserve.engine.parallel.ring import RingCommunicator, RingPass

FIT_TOKENS = (1024, 16384)      # the two block lengths timed at start (tokens per worker)


@dataclass(frozen=True)
class ExchangeTime:
    latency: float              # seconds per ring step, whatever its size
    seconds_per_byte: float     # and for each byte of the largest block in that step
    token_bytes: int            # one token's K and V in one layer: 2 * kv heads * head dim * element size

    @classmethod
    def measure(cls, ring: RingCommunicator, world_size: int, rank: int, block_shape: tuple,
                dtype: torch.dtype, device: torch.device, rounds: int = 3) -> "ExchangeTime":
        """Collective: every worker calls it at the same point. block_shape: one token's (2, Hkv, D)."""
        token_bytes = torch.Size(block_shape).numel() * dtype.itemsize
        steps = world_size - 1
        per_step = []
        for tokens in FIT_TOKENS:
            ring_pass = RingPass(ring, [tokens] * world_size, rank)
            local = torch.empty((tokens,) + tuple(block_shape), dtype=dtype, device=device)
            best = float("inf")
            for round_ in range(rounds + 1):             # round 0 allocates the buffers: untimed
                synchronize(device)
                start = time.perf_counter()
                ring_pass.run(local, lambda source, block: None)
                synchronize(device)
                if round_ > 0:
                    best = min(best, time.perf_counter() - start)
            per_step.append(best / steps)
        ring.collect_stats()                             # not any prefill's figures
        (small, t_small), (large, t_large) = zip((n * token_bytes for n in FIT_TOKENS), per_step)
        slope = max(0.0, (t_large - t_small) / (large - small))
        return cls(latency=max(0.0, t_small - slope * small), seconds_per_byte=slope, token_bytes=token_bytes)

    def layer_seconds(self, lengths: list[int]) -> float:
        """One layer's G - 1 exchanges alone for blocks of `lengths` tokens (one per worker): each step
        waits for its largest block."""
        return (len(lengths) - 1) * (self.latency + self.seconds_per_byte * max(lengths) * self.token_bytes)

    def prompt_seconds(self, shards, num_layers: int) -> float:
        """All layers' ring exchanges alone for a prompt placed as `shards` (arithmetic: the fit made at start)."""
        return self.layer_seconds([s.length for s in shards]) * num_layers

"""single: the whole prompt on one worker (LLM keeps only the first named device).

It is burst with one worker: one causal kernel call over the worker's own block, no ring, the
prompt in position order (zigzag over one worker: chunks 0 and 1).
"""
from burstserve.engine.parallel.burst_attention import BurstStrategy


class SingleStrategy(BurstStrategy):
    name = "single"
    max_workers = 1

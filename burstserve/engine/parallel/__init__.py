"""How a prefill spans the workers: one strategy per `--sp-strategy` name.

Every strategy answers the small interface in strategy.py (sharding, the attention callable, where
the K/V lives, the weights and their layout: weight_layout.py); ModelRunner asks it and never the
name. The ring, the shardings and each strategy's attention live beside it, one file each.
"""
from burstserve.engine.parallel.auto import AutoStrategy
from burstserve.engine.parallel.burst_attention import BurstNoLaoStrategy, BurstStrategy
from burstserve.engine.parallel.cqs import CQSStrategy
from burstserve.engine.parallel.ring_rsa import RingRSAStrategy
from burstserve.engine.parallel.single import SingleStrategy
from burstserve.engine.parallel.strategy import PrefillContext, PrefillStrategy, kv_view
from burstserve.engine.parallel.tensor_parallel import TensorParallelStrategy, TensorParallelV3Strategy
from burstserve.engine.parallel.ulysses import UlyssesStrategy
from burstserve.engine.parallel.zero import BurstZeroStrategy

# --sp-strategy name -> its strategy, in the order the CLI lists them
STRATEGIES: dict[str, type[PrefillStrategy]] = {s.name: s for s in (
    BurstStrategy,            # burst: BurstAttention over zigzag shards, K/V round the ring (default)
    AutoStrategy,             # auto: ulysses for short prompts, burst for long ones
    BurstNoLaoStrategy,       # burst-nolao: the burst ring with a materialized-score local kernel
    RingRSAStrategy,          # ring-rsa: ring self-attention, K round then V round
    UlyssesStrategy,          # ulysses: all-to-all over heads
    CQSStrategy,              # cqs: cyclic quorum sets over contiguous token groups
    TensorParallelStrategy,   # tp: heads and MLP split over the workers, K/V replicated
    TensorParallelV3Strategy,  # tp-v3: tp with the activations between the linears cut by sequence
    BurstZeroStrategy,        # burst-zero: burst over weights sharded as tp shards them, gathered per layer
    SingleStrategy,           # single: one worker
)}
SP_STRATEGIES = tuple(STRATEGIES)


def window_refusal(cfg, strategy: PrefillStrategy) -> str | None:
    """Why a model with sliding windows cannot run under this strategy, or None: its windowed layers run where every
    worker holds every position of the sequence (one worker, tp, tp-v3); the halo exchange over sequence shards is
    not built yet."""
    if cfg.has_windows and strategy.kv_workers > 1:
        return (f"a model with sliding-window attention (windows of {max(cfg.layer_windows)} tokens) runs on one "
                f"worker or under --sp-strategy tp / tp-v3 so far; {strategy.name} shards the sequence over "
                f"{strategy.world_size} workers")
    return None


def get_strategy(name: str, world_size: int) -> PrefillStrategy:
    """The strategy `name` built for world_size workers (KeyError: not a --sp-strategy name)."""
    return STRATEGIES[name](world_size)


__all__ = ["PrefillContext", "PrefillStrategy", "SP_STRATEGIES", "STRATEGIES", "get_strategy", "kv_view",
           "window_refusal"]

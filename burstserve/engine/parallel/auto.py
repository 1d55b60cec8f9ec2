"""auto: the prefill strategy chosen per prompt.

ulysses on short prompts (it has no per-ring-step cost, so it is the faster of the two there:
docs/benchmarks.md, Prefill: time to first token by strategy and GPU count) and burst on long ones, or
burst whenever the workers do not divide the query heads. Both keep the same zigzag KV layout (this
strategy's shards), so decoding does not care; each prefill reports the name of the one that ran it.
"""
from burstserve.engine.core.placement import Shard
from burstserve.engine.model.config import ModelConfig
from burstserve.engine.parallel.burst_attention import BurstStrategy
from burstserve.engine.parallel.strategy import Attention, PrefillContext, PrefillStrategy
from burstserve.engine.parallel.ulysses import UlyssesStrategy


class AutoStrategy(PrefillStrategy):
    name = "auto"

    def __init__(self, world_size: int):
        super().__init__(world_size)
        self.short, self.long = UlyssesStrategy(world_size), BurstStrategy(world_size)

    def fallback_note(self, cfg: ModelConfig) -> str | None:
        """The line to log at start when ulysses can never run here: the workers do not divide the heads."""
        if self.world_size > 1 and cfg.num_heads % self.world_size:
            return (f"--sp-strategy auto: the {cfg.num_heads} query heads do not divide over {self.world_size} "
                    f"workers, which ulysses needs, so every prompt runs burst")
        return None

    def for_prompt(self, num_tokens: int, ctx: PrefillContext) -> PrefillStrategy:
        short = num_tokens <= ctx.auto_ulysses_max_tokens
        heads_divide = self.world_size > 1 and ctx.num_heads % self.world_size == 0
        return self.short if short and heads_divide else self.long

    def attention(self, ctx: PrefillContext, shards: list[Shard], rank: int) -> Attention:
        return self.for_prompt(sum(s.length for s in shards), ctx).attention(ctx, shards, rank)

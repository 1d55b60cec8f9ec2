"""The prefill strategy interface: what ModelRunner asks of every `--sp-strategy`.

A strategy is built for the runner's world size W (`engine.parallel.get_strategy(name, W)`) and
answers:
  shards / shard_of / tokens_per_rank   how a prompt of N tokens is cut over the W workers;
  attention(ctx, shards, rank)          the attention callable of one prefill:
                                        (q [n, H, D], kv [n, 2, Hkv, D], between) -> out [n, H, D],
                                        where between() is the caller's work that needs no attention
                                        (the layer's K/V store): a ring queues it behind its first
                                        exchange (engine/parallel/ring.py, RingPass), the rest call it first;
  replicated_kv                         where the K/V lives: one shard per worker (False), or every
                                        token on every worker, for its own heads (True, tp); this
                                        decides where decoded tokens go, the decode all-gather's
                                        width, the capacity totals and a worker's share of a sequence;
  weight_slices / local_config          the weights: tp reads only its slice of each (and needs an
                                        all-reduce), every other strategy keeps them whole;
  weight_layout(cfg, rank, device)      a WeightLayout (engine/parallel/weight_layout.py): what the runner
                                        asks because of how a worker's weights lie: the model built on
                                        them, the vocabulary split and whole-layer gatherer (or None), the
                                        heads the K/V cache holds, the bytes to leave free, the eager
                                        extend attention, the longest prompt run on the slices and its
                                        prefill, a row's logits, prompt logprobs' scoring. All but
                                        burst-zero run the weights as they lie; burst-zero's ZeroLayout
                                        (engine/parallel/zero.py) gathers each layer's MLP whole for a
                                        prefill and decodes on the MLP's slices;
  sequence_parallel                     tp-v3 only: a prefill's activations cut by sequence between
                                        the parallel linears (engine/parallel/sequence_parallel.py);
  for_prompt                            the strategy that prefills one prompt (itself; `auto` picks);
  max_workers                           single: 1 (LLM keeps the first named device);
  option_refusal / model_refusal        why it cannot run with the engine's options, or split this model
                                        over its workers: LLM asks before any worker starts, and never
                                        compares the name;
  fallback_note(cfg)                    the line worker 0 logs at start when a way of the strategy never
                                        runs for this model here (auto: ulysses; burst-zero: the slices).
Decoding afterwards is the same for every strategy (engine/parallel/decode_attention.py; burst-zero's MLP on its
slices, all-reduced).
"""
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from burstserve.engine.core.placement import PromptPlacement, Shard, ShardLayout, worker_share
from burstserve.engine.model.config import ModelConfig
from burstserve.engine.parallel.ring import RingCommunicator
from burstserve.engine.parallel.weight_layout import WeightLayout
from burstserve.kernels.attention import AttentionBackend

# (q [n, H, D], kv [n, 2, Hkv, D], between: () -> None) -> [n, H, D]
Attention = Callable[[torch.Tensor, torch.Tensor, Callable[[], None]], torch.Tensor]


def kv_view(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [n, Hkv, D] -> [n, 2, Hkv, D], an Attention's kv: a view where v follows k in each row (as the qkv
    projection's output lays them out), else a stack. No ring sends it, so no copy is needed (a copy a layer
    is a measurable share of a short prefill)."""
    n, hkv, d = k.shape
    if (k.stride() == v.stride() and k.stride()[1:] == (d, 1)
            and v.data_ptr() == k.data_ptr() + hkv * d * k.element_size()):
        return k.as_strided((n, 2, hkv, d), (k.stride(0), hkv * d, d, 1))
    return torch.stack([k, v], dim=1)


@dataclass(frozen=True)
class PrefillContext:
    """What a strategy may use to build a prefill's attention; fixed for a runner's life."""
    backend: AttentionBackend          # the local kernel: (q, k, v, causal, scale) -> (out, lse)
    scale: float                       # the softmax scale (ModelConfig.scale: head_dim ** -0.5 unless the checkpoint says)
    ring: RingCommunicator | None      # the K/V ring; None with one worker or replicated K/V
    overlap: bool                      # ring exchanges overlap compute (--no-overlap: they do not)
    data_group: object = None          # the workers' data-plane process group (None: the default group)
    num_heads: int = 0                 # the model's query heads (auto: ulysses needs W to divide them)
    auto_ulysses_max_tokens: int = 0   # auto: the longest prompt that takes ulysses
    kv_fp8: bool = False               # --kv-cache-dtype fp8: K/V are FP8 values; a ring may send them as FP8


class PrefillStrategy:
    name = ""                  # the --sp-strategy name; a prefill reports the name of the one that ran it
    replicated_kv = False      # every worker holds every token's K/V (for its own heads), not a shard of them
    shard_layout = ShardLayout.ZIGZAG   # how its prompts are cut over the workers (engine/core/placement.py)
    times_exchanges = False    # its prefill runs the K/V ring, whose overlap is judged (engine/parallel/exchange_time.py)
    max_workers: int | None = None   # the most workers it runs on (LLM keeps that many devices); None: any number

    def __init__(self, world_size: int):
        self.world_size = world_size

    @property
    def placement(self) -> PromptPlacement:
        """Where its prompts' K/V go: what the scheduler's side plans pages with (engine/core/placement.py)."""
        return PromptPlacement(self.shard_layout, self.world_size, self.replicated_kv)

    def shards(self, num_tokens: int) -> list[Shard]:
        """The prompt's positions cut into shards, one per rank (as shard_layout says)."""
        return self.placement.shards(num_tokens)

    def shard_of(self, shards: list[Shard], rank: int) -> Shard:
        """The shard whose tokens this rank runs through the model (and keeps the K/V of)."""
        return self.placement.shard_of(shards, rank)

    def tokens_per_rank(self, shards: list[Shard]) -> list[int]:
        """Prompt tokens each worker stores in its KV cache, by rank."""
        return self.placement.tokens_per_rank(shards)

    @property
    def kv_workers(self) -> int:
        return self.placement.kv_workers

    def kv_share(self, max_model_len: int) -> int:
        """The most tokens of one sequence a worker holds (zigzag shards differ by at most one token a chunk)."""
        return worker_share(max_model_len, self.world_size, self.replicated_kv)

    @classmethod
    def option_refusal(cls, options: Mapping[str, object]) -> tuple[str, str] | None:
        """Why this strategy cannot run with these engine options (engine/options.py, by LLM keyword):
        (the reason, the option to name), or None. A strategy of one worker cannot span hosts."""
        if cls.max_workers == 1 and options["nnodes"] > 1:
            return (f"--sp-strategy {cls.name} runs on one device; it cannot span hosts (--nnodes {options['nnodes']})",
                    "sp_strategy")
        return None

    def model_refusal(self, cfg: ModelConfig) -> str | None:
        """Why this strategy cannot split this model over its world_size workers (every host's), or None."""
        return None

    def for_prompt(self, num_tokens: int, ctx: PrefillContext) -> "PrefillStrategy":
        """The strategy that prefills a prompt of num_tokens; it must keep self.shards' layout."""
        return self

    def fallback_note(self, cfg: ModelConfig) -> str | None:
        """A line for the log at start when this strategy will never run some of its ways here for this
        model (auto: never ulysses; burst-zero: whole weights); else None."""
        return None

    def attention(self, ctx: PrefillContext, shards: list[Shard], rank: int) -> Attention:
        """attention(q [n, H, D], kv [n, 2, Hkv, D], between) -> out [n, H, D] for one prefill, on this rank."""
        raise NotImplementedError

    def weight_slices(self, cfg: ModelConfig, rank: int) -> dict[str, tuple[int, int, int]]:
        """The part of each weight this worker reads: name -> (dim, start, stop); a name not listed is
        read whole. All but tp keep the weights whole."""
        return {}

    def local_config(self, cfg: ModelConfig, rank: int) -> tuple[ModelConfig, bool]:
        """This worker's model config (its heads and MLP width) and whether the model all-reduces the
        partial sums after o_proj and down_proj."""
        return cfg, False

    def weight_layout(self, cfg: ModelConfig, rank: int, device: torch.device, group=None) -> WeightLayout:
        """What the runner asks of this worker's weights (engine/parallel/weight_layout.py): all but
        burst-zero run the weights local_config describes as they lie."""
        return WeightLayout(cfg, *self.local_config(cfg, rank), rank, self.world_size, device, group)

    def sequence_parallel(self, num_tokens: int, rank: int, group=None):
        """A prefill's activations cut by sequence between tp's linears (tp-v3: a SequenceParallel), or
        None: the model runs this worker's shard whole."""
        return None

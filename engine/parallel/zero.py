"""BurstAttention+ZeRO (`burst-zero`): the BurstAttention paper's sixth method, weights sharded over the
workers as tensor parallelism shards them, so that sequence parallelism costs no more weight memory
than tp.

- Weights: each worker reads only tp's slice of every layer weight (engine/parallel/tensor_parallel.py:
  rows of q/k/v and gate/up, columns of o and down) and its vocabulary rows of the embedding and LM
  head (engine/parallel/vocab.py); only the norms are whole on every worker.
- Prefill and incremental prefills: the prompt is sharded by sequence and attends over the burst K/V
  ring, as `burst`; the model runs each layer with that layer's full weights, all-gathered from the
  shards one layer ahead (LayerGather: the gather of layer i + 1 is issued, on a process group of its
  own, before layer i computes) and dropped after use, so at most two layers are whole at a time.
- Decode: tensor-parallel on the shards as they lie (no weight moves: NVIDIA's "Helix" shape,
  engine/helix_decode.py): projections and MLP on the worker's heads and MLP slice with tp's
  all-reduces; attention over the sequence-sharded KV cache, every head on every worker.
The K/V cache is `burst`'s: each worker holds its tokens' K/V for every head.

Written on torch.distributed's collectives (all_gather_into_tensor with async_op, one process group for
the weights so that their gathers never queue behind the ring's exchanges): FSDP2's prefetching
all-gather wraps nn.Modules, and the model here is plain tensors and functions.
"""
import os
from typing import Mapping

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.decode_attention import stacked, start_all_gather
from engine.model import LayerWeights
from engine.parallel.burst_attention import BurstStrategy
from engine.parallel.tensor_parallel import local_kv_heads, tp_check, tp_local_config, tp_slices


class BurstZeroStrategy(BurstStrategy):
    """burst-zero: burst's prefill and K/V layout over weights sharded as tp shards them."""
    name = "burst-zero"

    @classmethod
    def option_refusal(cls, options: Mapping[str, object]) -> tuple[str, str] | None:
        """Its prefill gathers bfloat16 weights (no fp8), and runs on whole weights where decode runs on the
        slices (no chunk and decode step in one pass; mixed_batch None: auto, off here)."""
        if options["quantization"] != "none":
            return (f"burst-zero gathers bfloat16 weights; --quantization {options['quantization']} is not supported "
                    "with it", "quantization")
        if options["mixed_batch"]:
            return ("burst-zero runs a chunk on whole weights and decode on their slices, so a chunk and a decode "
                    "step cannot be one forward pass: leave --mixed-batch off", "mixed_batch")
        return super().option_refusal(options)

    def model_refusal(self, cfg: ModelConfig) -> str | None:
        return zero_check(cfg, self.world_size)

    @property
    def shards_weights(self) -> bool:
        return self.world_size > 1

    def weight_slices(self, cfg: ModelConfig, rank: int) -> dict[str, tuple[int, int, int]]:
        """tp's slices of every layer weight, and rows rank V/W .. of the embedding and LM head
        (engine/parallel/vocab.py)."""
        if not self.shards_weights:
            return {}
        per = cfg.vocab_size // self.world_size
        rows = (0, rank * per, (rank + 1) * per)
        vocab = {"model.embed_tokens.weight": rows} | ({} if cfg.tie_word_embeddings else {"lm_head.weight": rows})
        return tp_slices(cfg, rank, self.world_size) | vocab

    def local_config(self, cfg: ModelConfig, rank: int) -> tuple[ModelConfig, bool]:
        if not self.shards_weights:
            return cfg, False
        return tp_local_config(cfg, rank, self.world_size), True   # decode: all-reduce after o and down


def zero_check(cfg: ModelConfig, world_size: int) -> str | None:
    """Why burst-zero cannot slice this model over world_size workers, or None: tp's conditions, and every
    worker's query heads reading as many K/V heads (the gathers take equal slices)."""
    reason = tp_check(cfg, world_size)
    if reason is None and cfg.vocab_size % world_size:
        reason = (f"burst-zero cuts the embedding and LM head by vocabulary rows; {world_size} workers do not "
                  f"divide the {cfg.vocab_size} tokens")
    if reason is None and len({len(local_kv_heads(cfg, r, world_size)) for r in range(world_size)}) > 1:
        reason = (f"burst-zero slices the weights as tp does, and {world_size} workers' query heads would read "
                  f"unequal numbers of the {cfg.num_kv_heads} K/V heads ({cfg.num_heads} query heads)")
    return reason and reason.replace("tp splits", "burst-zero (as tp) splits", 1)


def qkv_row_index(cfg: ModelConfig, world_size: int) -> torch.Tensor:
    """Rows of the workers' stacked q/k/v slices ([W x rows_r], rank r's rows: its q heads, then k and v
    of the K/V heads they read) that make the whole q, k, v in order: every q head from its worker,
    every K/V head from the first worker holding it (several may, under GQA with fewer K/V heads than
    workers). The same index picks a whole [q, k, v] from the workers' stacked projection outputs."""
    d, per_q = cfg.head_dim, cfg.num_heads // world_size
    heads = [local_kv_heads(cfg, r, world_size) for r in range(world_size)]
    rows_r = (per_q + 2 * len(heads[0])) * d
    q = [r * rows_r + i for r in range(world_size) for i in range(per_q * d)]
    k, v = [], []
    for h in range(cfg.num_kv_heads):
        r = next(r for r in range(world_size) if h in heads[r])
        at = r * rows_r + per_q * d + heads[r].index(h) * d
        k += range(at, at + d)
        v += range(at + len(heads[r]) * d, at + len(heads[r]) * d + d)
    return torch.tensor(q + k + v, dtype=torch.int64)


def gate_up_row_index(cfg: ModelConfig, world_size: int) -> torch.Tensor:
    """Rows of the workers' stacked [gate_r; up_r] slices that make the whole [gate; up]."""
    per = cfg.intermediate_size // world_size
    gate = [r * 2 * per + i for r in range(world_size) for i in range(per)]
    return torch.tensor(gate + [g + per for g in gate], dtype=torch.int64)


# Operator's fallback: "data" puts burst-zero's layer gathers on the data group, queued behind the ring (no
# overlap), should a GPU hang with two NCCL communicators in flight (see LayerGather.__init__); default "own"
GATHER_GROUP_ENV = "BURSTSERVE_ZERO_GATHER_GROUP"


class LayerGather:
    """The full weights of layer i, all-gathered from every worker's tp slices (`layer(i)`, called for
    i = 0, 1, ... in order by every worker alike: collectives), with layer i + 1's gather started
    before layer i's weights are returned, so that it runs while layer i computes. Nothing is kept
    after use: at most two layers are whole at a time (one in use, one arriving)."""

    def __init__(self, cfg: ModelConfig, layers: list[LayerWeights], world_size: int, device: torch.device,
                 group=None):
        """cfg: the whole model's config; layers: this worker's slices (engine.model.LlamaModel.layers)."""
        self.cfg, self.layers, self.world_size, self.device = cfg, layers, world_size, device
        ranks = list(range(world_size)) if group is None else dist.get_process_group_ranks(group)
        # the weights' own queue (collective: all workers), beside the ring's on the data group. NCCL does not
        # promise progress to two communicators at once; every worker issues both in the same order, but
        # BURSTSERVE_ZERO_GATHER_GROUP=data queues the gathers behind the ring instead (no overlap)
        own = os.environ.get(GATHER_GROUP_ENV, "own") != "data"
        self.group = dist.new_group(ranks) if own else group
        self.qkv_index = qkv_row_index(cfg, world_size).to(device)
        self.gate_up_index = gate_up_row_index(cfg, world_size).to(device)
        self._arriving: dict[int, tuple[list, list]] = {}    # layer -> (gathered buffers, works)

    def layer(self, i: int) -> LayerWeights:
        if i not in self._arriving:
            self._start(i)
        if i + 1 < len(self.layers) and i + 1 not in self._arriving:
            self._start(i + 1)                               # the next layer's gather, behind this one
        buffers, works = self._arriving.pop(i)
        for w in works:
            w.wait()
        return self._assemble(self.layers[i], buffers)

    def layer_alone(self, i: int) -> LayerWeights:
        """Layer i's whole weights, gathered now and nothing behind it (to time one gather; collective)."""
        self._start(i)
        buffers, works = self._arriving.pop(i)
        for w in works:
            w.wait()
        return self._assemble(self.layers[i], buffers)

    def reserve_bytes(self) -> int:
        """GPU memory a prefill's gathers take at most: three whole layers (one in use, the next arriving, a
        gathered one being put in order), for the KV pool's sizing to leave free."""
        local = self.layers[0]
        sliced = sum(t.numel() * t.element_size() for t in (local.qkv, local.o, local.gate_up, local.down,
                                                               local.qkv_bias) if t is not None)
        return 3 * sliced * self.world_size

    def bytes_in_flight(self) -> int:
        """Bytes of the gathers started and not yet taken (at most one layer's whole weights)."""
        parts = [t for buffers, _ in self._arriving.values() for b in buffers for t in (b if isinstance(b, list) else [b])]
        return sum(t.numel() * t.element_size() for t in parts)

    def _start(self, i: int) -> None:
        local = self.layers[i]
        parts = [local.qkv, local.o, local.gate_up, local.down] + ([local.qkv_bias] if local.qkv_bias is not None else [])
        gathered = [start_all_gather(t, self.world_size, self.group, async_op=True) for t in parts]
        self._arriving[i] = ([g for g, _ in gathered], [w for _, w in gathered])

    def _assemble(self, local: LayerWeights, buffers: list) -> LayerWeights:
        """The gathered [W, ...] slices in the whole weights' layout."""
        qkv, o, gate_up, down = (stacked(b) for b in buffers[:4])
        bias = stacked(buffers[4]).reshape(-1).index_select(0, self.qkv_index) if len(buffers) > 4 else None
        return LayerWeights(
            qkv=qkv.flatten(0, 1).index_select(0, self.qkv_index),              # [(H + 2 Hkv) D, hidden]
            qkv_bias=bias,
            o=o.permute(1, 0, 2).flatten(1),                                    # [hidden, H D]
            gate_up=gate_up.flatten(0, 1).index_select(0, self.gate_up_index),  # [2 I, hidden]
            down=down.permute(1, 0, 2).flatten(1),                              # [hidden, I]
            input_norm=local.input_norm, post_norm=local.post_norm)

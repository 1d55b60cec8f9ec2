"""Per-worker KV cache: for each sequence, the K/V of the tokens this worker holds, every layer.

Layout per sequence: kv [num_layers, capacity, 2, Hkv, D]. A layer's first n tokens,
kv[layer, :n], are one contiguous [n, 2, Hkv, D] block: K and V travel the ring as that one
message, straight from the cache. Token order within a worker does not matter for attention
(RoPE is applied before caching), so decoded tokens are appended at the end.
"""
import torch


class SequenceKV:
    def __init__(self, num_layers: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.kv = torch.empty(num_layers, capacity, 2, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.length = 0   # tokens whose K/V are complete for every layer

    @property
    def capacity(self) -> int:
        return self.kv.shape[1]

    def block(self, layer: int, num_tokens: int) -> torch.Tensor:
        """[num_tokens, 2, Hkv, D], contiguous."""
        return self.kv[layer, :num_tokens]

    def ensure_capacity(self, num_tokens: int) -> None:
        if num_tokens <= self.capacity:
            return
        grown = torch.empty((self.kv.shape[0], max(num_tokens, 2 * self.capacity)) + self.kv.shape[2:],
                            dtype=self.kv.dtype, device=self.kv.device)
        grown[:, :self.length] = self.kv[:, :self.length]
        self.kv = grown

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, Hkv, D] into slots [start, start + n) of a layer."""
        self.kv[layer, start:start + k.shape[0], 0] = k
        self.kv[layer, start:start + k.shape[0], 1] = v


class KVCache:
    """All sequences' caches on one worker."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.seqs: dict[int, SequenceKV] = {}

    def allocate(self, seq_id: int, capacity: int) -> SequenceKV:
        layers, hkv, d = self.shape
        seq = SequenceKV(layers, max(capacity, 1), hkv, d, self.dtype, self.device)
        self.seqs[seq_id] = seq
        return seq

    def free(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def tokens_held(self) -> int:
        return sum(s.length for s in self.seqs.values())

    def bytes_reserved(self) -> int:
        return sum(s.kv.numel() * s.kv.element_size() for s in self.seqs.values())


def next_kv_owner(tokens_per_worker: list[int]) -> int:
    """The worker that stores a sequence's next token: the one holding fewest (lowest rank on ties)."""
    return tokens_per_worker.index(min(tokens_per_worker))

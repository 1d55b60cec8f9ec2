"""The embedding and the LM head cut by vocabulary rows over the workers (`burst-zero`), so that no
worker holds more than its share of any weight: worker r holds rows r V/W .. (r + 1) V/W of each.

- Embedding of rows that every worker runs alike (a decode step's tokens, a "whole" extend): each
  worker looks up the ids in its rows (zero for the others) and one all-reduce sums them; only one
  worker contributes to each id, so the sum is exact in any dtype.
- Embedding of a prefill's own rows (different on every worker): the table is all-gathered whole for
  that forward pass and dropped after it, as burst-zero gathers a layer (engine/parallel/zero.py).
- Logits of rows that every worker holds alike: each worker multiplies by its rows of the LM head, one
  all-gather puts the vocabulary back in order ([B, V] fp32 on every worker).
Every call is collective: every worker makes it with the same shapes. Capturable in CUDA graphs.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.decode_attention import all_gather


class VocabShards:
    def __init__(self, vocab_size: int, rank: int, world_size: int, group=None):
        self.per = vocab_size // world_size
        self.start, self.world_size, self.group = rank * self.per, world_size, group

    def embed(self, token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """token_ids [S] (the same on every worker), table [V/W, hidden] (this worker's rows) -> [S, hidden]."""
        local = token_ids - self.start
        inside = (local >= 0) & (local < self.per)
        out = F.embedding(local.clamp(0, self.per - 1), table) * inside[:, None].to(table.dtype)
        dist.all_reduce(out, group=self.group)
        return out

    def whole_table(self, table: torch.Tensor) -> torch.Tensor:
        """This worker's rows [V/W, hidden] -> the whole table [V, hidden], gathered (for one forward pass)."""
        return all_gather(table, self.world_size, self.group).flatten(0, 1)

    def logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] (the same on every worker), head [V/W, hidden] -> logits [B, V] fp32."""
        part = F.linear(hidden, head).float()                                  # [B, V/W]
        return all_gather(part, self.world_size, self.group).permute(1, 0, 2).flatten(1)

    def bytes_of_whole_table(self, table: torch.Tensor) -> int:
        return table.numel() * table.element_size() * self.world_size

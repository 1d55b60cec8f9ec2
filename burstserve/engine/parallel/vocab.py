"""The embedding and the LM head cut by vocabulary rows over the workers (`burst-zero`), so that no
worker holds more than its share of any weight: worker r holds rows r V/W .. (r + 1) V/W of each.

- Embedding of rows that every worker runs alike (a decode step's tokens, a "whole" extend): each
  worker looks up the ids in its rows (zero for the others) and one all-reduce sums them; only one
  worker contributes to each id, so the sum is exact in any dtype.
- Embedding of a prefill's own rows (different on every worker): the table is all-gathered whole for
  that forward pass and dropped after it, as burst-zero gathers a layer (engine/parallel/zero.py).
- Logits of rows that every worker holds alike: each worker multiplies by its rows of the LM head, one
  all-gather puts the vocabulary back in order ([B, V] fp32 on every worker); so a prefill's last row goes
  to every worker first (ZeroLayout.logits_of_row), and its prompt logprobs score every worker's rows on
  every worker, a window of rows at a time (score_every_row).
Every call is collective: every worker makes it with the same shapes. Capturable in CUDA graphs.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from burstserve.engine.core.prompt_logprobs import CHUNK_ROWS, score_rows
from burstserve.engine.parallel.decode_attention import all_gather, all_gather_rows


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


def score_every_row(model, hidden: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor, top: int,
                    world_size: int, group=None) -> list[dict]:
    """engine/core/prompt_logprobs.py's scores of every worker's rows (hidden [n_w, hidden] at positions [n_w] on
    the device), on every worker (the LM head is a collective call), gathered a window at a time: at most
    CHUNK_ROWS rows [.., hidden] in flight, not the whole prompt's (8 GB a worker at 1M tokens of an 8B model)."""
    counts = all_gather(torch.tensor([hidden.shape[0]], device=hidden.device), world_size, group)
    lengths = counts.flatten().tolist()
    width = max(1, CHUNK_ROWS // world_size)                         # rows a worker adds to one window
    parts = []
    for start in range(0, max(lengths), width):                      # the same windows on every worker
        window = [min(max(n - start, 0), width) for n in lengths]
        rows = slice(start, start + width)
        parts.append(score_rows(model, all_gather_rows(hidden[rows], window, group),
                                all_gather_rows(positions[rows], window, group), token_ids, top))
    return parts

"""Online-softmax merge of partial attention results, in fp32.

A partial result over a block of keys is (out, lse): out is softmax-weighted V over that block,
lse the log-sum-exp of the block's scores. Two partials combine as
    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)
An empty or fully masked block has lse = -inf and contributes nothing; two such blocks merge to
out = 0, lse = -inf (never NaN).
"""
import torch


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return lse, torch.exp(lse_a - finite), torch.exp(lse_b - finite)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place: out [S, H, D] fp32, lse [S, H] fp32 absorb block_out [S, H, D] (any dtype), block_lse [S, H]."""
    new_lse, w_old, w_new = _weights(lse, block_lse.float())
    out.mul_(w_old.unsqueeze(-1)).add_(block_out.float() * w_new.unsqueeze(-1))
    lse.copy_(new_lse)


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [P, ..., D], lses [P, ...] (P partials of the same queries) -> (out [..., D] fp32, lse [...] fp32)."""
    lses = lses.float()
    lse = torch.logsumexp(lses, dim=0)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(lses - finite.unsqueeze(0))          # [P, ...]; 0 for empty partials
    out = (outs.float() * weights.unsqueeze(-1)).sum(dim=0)
    return out, lse

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
    """In place: out [S, H, D], lse [S, H] fp32 absorb block_out [S, H, D] (any dtype), block_lse [S, H].
    Computed in fp32; an out of a narrower dtype (bf16) is rounded once, when written back.
    kernels.fused.merge_ is the same in one kernel on CUDA."""
    new_lse, w_old, w_new = _weights(lse, block_lse.float())
    if out.dtype == torch.float32:
        out.mul_(w_old.unsqueeze(-1)).add_(block_out.float() * w_new.unsqueeze(-1))
    else:
        out.copy_(out.float() * w_old.unsqueeze(-1) + block_out.float() * w_new.unsqueeze(-1))
    lse.copy_(new_lse)


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [P, ..., D], lses [P, ...] (P partials of the same queries) -> (out [..., D] fp32, lse [...] fp32)."""
    lses = lses.float()
    lse = torch.logsumexp(lses, dim=0)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(lses - finite.unsqueeze(0))          # [P, ...]; 0 for empty partials
    out = (outs.float() * weights.unsqueeze(-1)).sum(dim=0)
    return out, lse


def merge_stacked_masked(outs: torch.Tensor, lses: torch.Tensor, valid: torch.Tensor,
                         dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_stacked over dimension `dim` (>= 0) of outs [..., D] / lses [...], where partials with
    valid False weigh 0 whatever outs and lses hold there (NaN, inf, garbage: never read into the
    result). valid: bool, lses.ndim dimensions, broadcastable to lses. No valid partial: out 0,
    lse -inf. -> (out fp32 without `dim`, lse fp32 without `dim`). 13 elementwise/reduction ops."""
    l = torch.where(valid, lses.float(), float("-inf"))
    m = l.amax(dim, keepdim=True).clamp_(min=torch.finfo(torch.float32).min)   # finite: -inf - m = -inf
    w = (l - m).exp_()                                                         # 0 for invalid partials
    s = w.sum(dim, keepdim=True)          # 0 (no valid partial) or >= 1 (the largest contributes exp(0) = 1)
    lse = s.log().add_(m).squeeze(dim)    # log 0 + finite = -inf
    w = w / s.clamp_(min=1.0)
    out = (torch.where(valid.unsqueeze(-1), outs, 0.0) * w.unsqueeze(-1)).sum(dim)
    return out.float(), lse

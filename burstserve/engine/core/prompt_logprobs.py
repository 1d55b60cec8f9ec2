"""Prompt logprobs (vLLM's `prompt_logprobs`): for every prompt position after the first, the
logprob of the prompt's own token there and the `top` most likely tokens. Each worker scores the
positions whose hidden states it holds after prefill, a chunk of rows at a time (a [chunk, V]
fp32 slab, never [N, V]); worker 0 gathers them in position order.
"""
import torch
import torch.distributed as dist

CHUNK_ROWS = 1024


@torch.inference_mode()
def score_rows(model, hidden: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor, top: int) -> dict:
    """hidden [n, hidden] at global `positions` [n] (any order); token_ids [N] (CPU int64).
    -> {"positions" [m], "chosen" [m], "top_ids" [m, top], "top_values" [m, top]} on the CPU, for the
    rows that predict a prompt token (position p < N - 1 predicts token p + 1)."""
    positions = positions.cpu()
    rows = torch.nonzero(positions < token_ids.shape[0] - 1).squeeze(1)          # [m]
    targets = token_ids[positions[rows] + 1]                                      # [m]
    chosen, top_ids, top_values = [], [], []
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        chunk = rows[start:start + CHUNK_ROWS]
        logp = torch.log_softmax(model.logits(hidden[chunk.to(hidden.device)]), dim=-1)   # [c, V] fp32
        chosen.append(logp.gather(1, targets[start:start + CHUNK_ROWS, None].to(logp.device)).squeeze(1).cpu())
        values, ids = torch.topk(logp, top, dim=-1) if top else (logp[:, :0], logp[:, :0].long())
        top_ids.append(ids.cpu())
        top_values.append(values.cpu())
    empty = torch.empty(0)
    return {"positions": positions[rows],
            "chosen": torch.cat(chosen) if chosen else empty,
            "top_ids": torch.cat(top_ids) if top_ids else empty.long().view(0, top),
            "top_values": torch.cat(top_values) if top_values else empty.view(0, top)}


def gather_scores(scores: dict, world_size: int, group) -> list[dict]:
    """Every worker's scores, on every worker (one all_gather_object over the data group)."""
    if world_size == 1:
        return [scores]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, scores, group=group)
    return everyone


def as_entries(parts: list[dict], token_ids: torch.Tensor) -> list[dict[int, float] | None]:
    """Scores of all workers -> one entry per prompt position: None for the first, then
    {token_id: logprob} with the top tokens and the prompt's own (the decode logprobs' format)."""
    entries: list[dict[int, float] | None] = [None] * token_ids.shape[0]
    for part in parts:
        for p, lp, ids, values in zip(part["positions"].tolist(), part["chosen"].tolist(), part["top_ids"].tolist(),
                                      part["top_values"].tolist()):
            entry = {int(i): float(v) for i, v in zip(ids, values)}
            entry[int(token_ids[p + 1])] = float(lp)
            entries[p + 1] = entry
    return entries

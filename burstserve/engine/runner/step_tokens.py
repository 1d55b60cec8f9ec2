"""Every token the engine samples on a device: a decode step's tokens and a prompt's next token, sampled from
their logits on worker 0's device: returned to the host now (`sampled_result`, `sampled_next`), or left on
the device for the next step and read by the host later (`FedTokens.keep`).

Asynchronous scheduling (engine/scheduler/scheduler.py): worker 0 launches step k+1 before it has read step k's
tokens, so step k+1's input tokens come from the device: every worker keeps the last kept step's tokens
in its FedTokens ([max_num_seqs + 1] int64; worker 0 samples them, the others receive them by one
broadcast), and a step whose rows are `fed_from` the previous one gathers its tokens there. The host
gets step k's tokens (and logprobs) from pinned copies made right after they were sampled, waiting on
their event only when it needs them (by then step k+1 is queued, so the GPU never idles for the host's
work between two steps).
"""
import torch
import torch.distributed as dist

from burstserve.engine.core.calls import Decode, DecodeResult, PrefillResult, SampleNext
from burstserve.engine.core.devices import host_to_device
from burstserve.engine.core.sampling import (RowSampling, logprob_entries, rows_logprobs, sample_rows, step_rules,
                                            top_logprobs)
from burstserve.engine.parallel.weight_layout import global_rank


def sampled_result(logits: torch.Tensor, sampling: "list[RowSampling] | None", host_rows: list[int]) -> DecodeResult:
    """A step's logits [B, V] fp32 on worker 0 -> every row's token (the argmax, or drawn on the device by its
    RowSampling), the logits of the rows the host samples (grammars), per row its logprobs where asked."""
    tokens = sample_rows(logits, sampling)                               # [B] on the device
    logprobs = None
    wanted = [i for i, r in enumerate(sampling or []) if r.logprobs is not None and i not in host_rows]
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        entries = rows_logprobs(logits[rows], tokens[rows], [sampling[i].logprobs for i in wanted])
        logprobs = [None] * logits.shape[0]
        for i, entry in zip(wanted, entries):
            logprobs[i] = entry
    return DecodeResult(tokens.tolist(), logits[host_rows].cpu() if host_rows else logits[:0].cpu(), logprobs)


def sampled_next(logits: torch.Tensor, how: SampleNext) -> tuple[int | None, dict | None, torch.Tensor | None]:
    """A prompt's last logits [V] fp32 on worker 0 -> (its next token, drawn there as a decode step's row is,
    or None for a grammar's row; its logprobs entry where the rule asks; the logits [V] on the host where
    asked)."""
    host = logits.cpu() if how.on_host or how.logits else None
    if how.on_host:
        return None, None, host
    step = sampled_result(logits[None], step_rules([how.rule]), [])
    return step.tokens[0], step.logprobs[0] if step.logprobs else None, host


def with_step(result: PrefillResult, decode_logits: torch.Tensor | None, step: Decode | None, rank: int):
    """On worker 0, a mixed batch's decode step's sampled result in result.decode."""
    if step is not None and rank == 0:
        result.decode = sampled_result(decode_logits, step.sampling, step.host_rows)
    return result


class FedTokens:
    """A worker's copy of the last kept step's tokens, the input of a step `fed_from` it."""

    def __init__(self, rows: int, device: torch.device, rank: int, world_size: int, group=None):
        """rows: the largest batch (max_num_seqs + 1: a short prompt beside one prefilled in chunks)."""
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)    # [rows]
        self.rank, self.world_size, self.group = rank, world_size, group

    def rows(self, fed_from: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the kept tokens, the rows of them a step's sequences take as input, on the device)."""
        return self.tokens, host_to_device(torch.tensor(fed_from), self.tokens.device)

    def keep(self, logits: torch.Tensor, sampling: "list[RowSampling] | None") -> "PendingTokens | None":
        """A step's tokens [B] (worker 0 samples them from logits [B, V]) kept on every worker, with no host
        synchronization -> on worker 0 their host copy, pending."""
        b = logits.shape[0]
        kept = self.tokens[:b]
        logprobs = None
        if self.rank == 0:
            tokens = sample_rows(logits, sampling)
            kept.copy_(tokens)
            rows = [i for i, r in enumerate(sampling or []) if r.logprobs is not None]
            if rows:
                tops = [sampling[i].logprobs for i in rows]
                index = host_to_device(torch.tensor(rows), logits.device)
                logprobs = (rows, tops, *top_logprobs(logits.index_select(0, index), tokens.index_select(0, index),
                                                       max(tops)))
        if self.world_size > 1:
            dist.broadcast(kept, src=global_rank(0, self.group), group=self.group)
        return PendingTokens(kept, logprobs) if self.rank == 0 else None


class PendingTokens:
    """A step's tokens [B] on the device (and, for the rows asking logprobs, engine.sampling.top_logprobs'
    tensors) -> their host copies, started now and waited for in result()."""

    def __init__(self, tokens: torch.Tensor, logprobs: tuple | None = None):
        """logprobs: (rows [list], their tops [list], top_logprobs' four tensors of those rows) or None."""
        self.rows, self.tops = (logprobs[0], logprobs[1]) if logprobs else ([], [])
        tensors = [tokens, *logprobs[2:]] if logprobs else [tokens]
        if tokens.device.type == "cuda":
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = [t.clone() for t in tensors], None

    def result(self) -> tuple[list[int], list | None]:
        """(every row's token, per row its logprobs entry or None; None when no row asked)."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.host[0].tolist()
        if not self.rows:
            return tokens, None
        logprobs = [None] * len(tokens)
        for row, entry in zip(self.rows, logprob_entries(*self.host[1:], self.tops)):
            logprobs[row] = entry
        return tokens, logprobs

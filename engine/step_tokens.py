"""A decode step's sampled tokens, left on the device for the next step and read by the host later.

Asynchronous scheduling (engine/scheduler.py): worker 0 launches step k+1 before it has read step k's
tokens, so step k+1's input tokens come from the device: every worker keeps the last kept step's tokens
in ModelRunner.fed_tokens ([max_num_seqs + 1] int64; worker 0 samples them, the others receive them by one
broadcast), and a step whose rows are `fed_from` the previous one gathers its tokens there. The host
gets step k's tokens (and logprobs) from pinned copies made right after they were sampled, waiting on
their event only when it needs them (by then step k+1 is queued, so the GPU never idles for the host's
work between two steps).
"""
import torch

from engine.sampling import logprob_entries


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

"""A decode step's sampled tokens, left on the device for the next step and read by the host later.

Asynchronous scheduling (engine/scheduler.py): worker 0 launches step k+1 before it has read step k's
tokens, so step k+1's input tokens come from the device: every worker keeps the last kept step's tokens
in `fed` ([max_num_seqs] int64; worker 0 samples them, the others receive them by one broadcast), and a
step whose rows are `fed_from` the previous one gathers its tokens there. The host gets step k's tokens
from a pinned copy made right after they were sampled, waiting on its event only when it needs them
(by then step k+1 is queued, so the GPU never idles for the host's work between two steps).
"""
import torch


class PendingTokens:
    """tokens [B] int64 on the device -> their host copy, started now and waited for in result()."""

    def __init__(self, tokens: torch.Tensor):
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = tokens.clone(), None

    def result(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


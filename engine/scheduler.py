"""Worker 0's loop: admit requests, prefill one at a time across all workers, decode the running
ones together in one batch, sample, and send each token back as soon as it exists."""
import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.outputs import Request, StepOutput
from engine.sampling import make_generator, sample_one, token_logprobs

log = logging.getLogger(__name__)


@dataclass
class RunningSequence:
    request: Request
    seq_id: int
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    aborted: bool = False


class Scheduler:
    def __init__(self, call: Callable, requests: "queue.Queue", outputs: "queue.Queue", world_size: int,
                 max_num_seqs: int, max_model_len: int, eos_token_ids: list[int]):
        self.call, self.requests, self.outputs = call, requests, outputs
        self.world_size, self.max_num_seqs, self.max_model_len = world_size, max_num_seqs, max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[RunningSequence] = []
        self.aborted: set[str] = set()
        self.next_seq_id = 0

    def run(self) -> None:
        while self._poll(block=not (self.waiting or self.running)):
            self._drop_aborted()
            if self.waiting and len(self.running) < self.max_num_seqs:
                self._prefill(self.waiting.popleft())
            elif self.running:
                self._decode()

    def _poll(self, block: bool) -> bool:
        """Takes every pending message; False on shutdown."""
        while True:
            try:
                msg = self.requests.get(timeout=0.5) if block else self.requests.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            block = False
            if msg[0] == "shutdown":
                return False
            if msg[0] == "add":
                self.waiting.append(msg[1])
            elif msg[0] == "abort":
                self.aborted.add(msg[1])

    def _drop_aborted(self) -> None:
        if not self.aborted:
            return
        self.waiting = deque(r for r in self.waiting if r.request_id not in self.aborted)
        gone = [s for s in self.running if s.request.request_id in self.aborted]
        if gone:
            self.call("free", [s.seq_id for s in gone])
            self.running = [s for s in self.running if s.request.request_id not in self.aborted]
        self.aborted.clear()

    def _prefill(self, request: Request) -> None:
        seq = RunningSequence(request, self.next_seq_id, make_generator(request.params, torch.device("cpu")))
        self.next_seq_id += 1
        room = self.max_model_len - len(request.prompt_token_ids)
        reserve = min(request.params.max_tokens, max(room, 0)) // self.world_size + 2
        result = self.call("prefill", seq.seq_id, torch.tensor(request.prompt_token_ids, dtype=torch.int64), reserve)
        logits = result.pop("logits")
        self._emit(seq, logits, prefill=result, keep_logits=request.return_logits)

    def _decode(self) -> None:
        batch = list(self.running)
        tokens = [s.generated[-1] for s in batch]
        positions = [len(s.request.prompt_token_ids) + len(s.generated) - 1 for s in batch]
        logits = self.call("decode", [s.seq_id for s in batch], tokens, positions)    # [B, V]
        self.running = []
        for i, seq in enumerate(batch):
            self._emit(seq, logits[i])

    def _emit(self, seq: RunningSequence, logits: torch.Tensor, prefill: dict | None = None,
              keep_logits: bool = False) -> None:
        params = seq.request.params
        token = sample_one(logits, params, seq.generator)
        seq.generated.append(token)
        logprobs = token_logprobs(logits, token, params.logprobs) if params.logprobs is not None else None
        reason = self._finish_reason(seq, token)
        self.outputs.put(("out", StepOutput(seq.request.request_id, token, logprobs, reason, time.time(),
                                            prefill=prefill, logits=logits.clone() if keep_logits else None)))
        if reason is None:
            self.running.append(seq)
        else:
            self.call("free", [seq.seq_id])

    def _finish_reason(self, seq: RunningSequence, token: int) -> str | None:
        params = seq.request.params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        if len(seq.generated) >= params.max_tokens:
            return "length"
        if len(seq.request.prompt_token_ids) + len(seq.generated) >= self.max_model_len:
            return "length"
        return None

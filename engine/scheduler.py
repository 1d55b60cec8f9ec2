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
from engine.structured_output import GrammarBackend, SequenceGrammar, TokenizerSource, mask_logits

log = logging.getLogger(__name__)


@dataclass
class RunningSequence:
    request: Request
    seq_id: int
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    aborted: bool = False
    prompt_logits: torch.Tensor | None = None    # [V] fp32, the prefill's: a twin's first token samples from it
    grammar: SequenceGrammar | None = None       # response_format: masks what this sequence may sample


class Scheduler:
    def __init__(self, call: Callable, requests: "queue.Queue", outputs: "queue.Queue", world_size: int,
                 max_num_seqs: int, max_model_len: int, eos_token_ids: list[int], kv_capacity_per_worker: int,
                 kv_capacity_total: int, kv_tokens_per_worker: Callable[[], list[int]]):
        self.call, self.requests, self.outputs = call, requests, outputs
        self.world_size, self.max_num_seqs, self.max_model_len = world_size, max_num_seqs, max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.kv_capacity_per_worker = kv_capacity_per_worker
        self.kv_capacity_total = kv_capacity_total     # tokens admitted over all workers
        self.kv_tokens_per_worker = kv_tokens_per_worker
        self.kv_reserved = 0          # tokens promised to running sequences (prompt + what they may generate)
        self._published: tuple | None = None
        self._published_at = 0.0
        self.waiting: deque[Request] = deque()
        self.running: list[RunningSequence] = []
        self.aborted: set[str] = set()
        self.next_seq_id = 0
        self.grammars: dict[TokenizerSource, GrammarBackend] = {}   # built at the first response_format

    def run(self) -> None:
        while True:
            self._publish_stats()
            if not self._poll(block=not (self.waiting or self.running)):
                return
            self._drop_aborted()
            if self.waiting and self._can_admit(self.waiting[0]):
                self._prefill(self.waiting.popleft())
            elif self.running:
                self._decode()

    def _kv_needed(self, request: Request) -> int:
        return min(len(request.prompt_token_ids) + request.params.max_tokens, self.max_model_len)

    def _can_admit(self, request: Request) -> bool:
        """First come, first served: the head waits until a batch slot and its KV tokens are free."""
        return (len(self.running) < self.max_num_seqs
                and self.kv_reserved + self._kv_needed(request) <= self.kv_capacity_total)

    def _publish_stats(self) -> None:
        """Sends worker 0's figures when they change (at most every 0.25 s while busy)."""
        kv = self.kv_tokens_per_worker()
        state = (len(self.running), len(self.waiting), tuple(kv))
        now = time.monotonic()
        if state == self._published or (now - self._published_at < 0.25 and self.running and
                                        state[:2] == self._published[:2]):
            return
        self._published, self._published_at = state, now
        self.outputs.put(("stats", {"running": state[0], "waiting": state[1], "kv_tokens_per_worker": kv,
                                    "kv_capacity_per_worker": self.kv_capacity_per_worker}))

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
            self._free(gone)
            self.running = [s for s in self.running if s.request.request_id not in self.aborted]
        self.aborted.clear()

    def _prefill(self, request: Request) -> None:
        seq = RunningSequence(request, self.next_seq_id, make_generator(request.params, torch.device("cpu")),
                              grammar=self._grammar(request))
        self.next_seq_id += 1
        self.kv_reserved += self._kv_needed(request)
        room = self.max_model_len - len(request.prompt_token_ids)
        reserve = min(request.params.max_tokens, max(room, 0)) // self.world_size + 2
        twin = self._running_twin(request)
        if twin is not None:   # the same prompt is already in the cache: copy its K/V instead of a prefill
            self.call("fork", twin.seq_id, seq.seq_id, reserve)
            logits, result = twin.prompt_logits, {"prefill_seconds": 0.0, "shared_prefill": True}
        else:
            called = time.perf_counter()
            result = self.call("prefill", seq.seq_id, torch.tensor(request.prompt_token_ids, dtype=torch.int64),
                               reserve, request.params.prompt_logprobs)
            result["call_seconds"] = time.perf_counter() - called   # the prefill call as worker 0's scheduler saw it
            logits = result.pop("logits")
        seq.prompt_logits = logits
        self._emit(seq, logits, prefill=result, keep_logits=request.return_logits,
                   prompt_logprobs=result.pop("prompt_logprobs", None))

    def _grammar(self, request: Request) -> SequenceGrammar | None:
        """A fresh matcher for a constrained request (each of n choices has its own); the grammar is
        compiled at the first request with this response_format, then taken from the cache."""
        if request.structured is None:
            return None
        source = request.structured.source
        backend = self.grammars.get(source)
        if backend is None:
            backend = self.grammars[source] = GrammarBackend(source)
        return backend.matcher(request.structured.spec)

    def _running_twin(self, request: Request) -> RunningSequence | None:
        """A running sequence with exactly this prompt (say the n choices of one request), if any; not
        for a request that wants prompt logprobs (they come out of a prefill)."""
        if request.params.prompt_logprobs is not None:
            return None
        ids = request.prompt_token_ids
        return next((s for s in self.running if not s.aborted and len(s.request.prompt_token_ids) == len(ids)
                     and s.request.prompt_token_ids == ids), None)

    def _decode(self) -> None:
        batch = list(self.running)
        tokens = [s.generated[-1] for s in batch]
        positions = [len(s.request.prompt_token_ids) + len(s.generated) - 1 for s in batch]
        logits = self.call("decode", [s.seq_id for s in batch], tokens, positions)    # [B, V]
        constrained = [i for i, s in enumerate(batch) if s.grammar is not None]
        masked = {}
        if constrained:   # a masked copy of those rows, in one call; logprobs still read the model's logits
            rows = mask_logits(logits[constrained], [batch[i].grammar for i in constrained])
            masked = {i: rows[j] for j, i in enumerate(constrained)}
        self.running = []
        for i, seq in enumerate(batch):
            self._emit(seq, logits[i], sample_logits=masked.get(i))

    def _emit(self, seq: RunningSequence, logits: torch.Tensor, prefill: dict | None = None,
              keep_logits: bool = False, prompt_logprobs: list | None = None,
              sample_logits: torch.Tensor | None = None) -> None:
        """Samples from `sample_logits` (the grammar-masked logits) when given or when the sequence has
        a grammar, else from `logits`; the logprobs are always the model's own (unmasked) `logits`."""
        params = seq.request.params
        if sample_logits is None and seq.grammar is not None:
            sample_logits = mask_logits(logits.unsqueeze(0).clone(), [seq.grammar])[0]
        token = sample_one(logits if sample_logits is None else sample_logits, params, seq.generator)
        seq.generated.append(token)
        logprobs = token_logprobs(logits, token, params.logprobs) if params.logprobs is not None else None
        reason = self._finish_reason(seq, token)
        self.outputs.put(("out", StepOutput(seq.request.request_id, token, logprobs, reason, time.time(),
                                            prefill=prefill, logits=logits.clone() if keep_logits else None,
                                            prompt_logprobs=prompt_logprobs)))
        if reason is None:
            self.running.append(seq)
        else:
            self._free([seq])

    def _free(self, seqs: list[RunningSequence]) -> None:
        self.call("free", [s.seq_id for s in seqs])
        self.kv_reserved -= sum(self._kv_needed(s.request) for s in seqs)

    def _finish_reason(self, seq: RunningSequence, token: int) -> str | None:
        params = seq.request.params
        grammar_ended = False
        if seq.grammar is not None:
            if not seq.grammar.accept(token):   # cannot happen with a masked sample; never run on off-grammar
                log.error("request %s: token %d does not match its response_format; ending it",
                          seq.request.request_id, token)
                return "abort"
            grammar_ended = seq.grammar.terminated   # its stop token accepted: ends even with ignore_eos
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos) or grammar_ended:
            return "stop"
        if len(seq.generated) >= params.max_tokens:
            return "length"
        if len(seq.request.prompt_token_ids) + len(seq.generated) >= self.max_model_len:
            return "length"
        return None

"""Worker 0's loop: admit requests, prefill one at a time across all workers, decode the running
ones together in one batch, sample, and send each token back as soon as it exists.

KV pages (engine/cache): a request is admitted when its prompt's pages fit on every worker (with a
small watermark left for the running sequences to grow); nothing is reserved for the tokens it may
generate. When a decode step needs more pages than a worker has free, the newest running sequence
is preempted (its pages freed) and later recomputed, before any new request: one prefill over its
prompt and the tokens it had generated, after which it goes on sampling with the same generator, so
a seeded or greedy request gives the same tokens as if it had never been preempted (vLLM's
recompute preemption)."""
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
    preemptions: int = 0                         # times preempted (its cache now starts with prompt + generated)

    @property
    def needs_logits(self) -> bool:
        """Does sampling this sequence's next token need its logits on the host (not just the argmax)?"""
        params = self.request.params
        return not params.greedy or params.logprobs is not None or self.grammar is not None


class Scheduler:
    def __init__(self, call: Callable, requests: "queue.Queue", outputs: "queue.Queue", max_num_seqs: int,
                 max_model_len: int, eos_token_ids: list[int], kv):
        """kv: worker 0's ModelRunner, for its KV ledger (the same on every worker) and prefill_pages."""
        self.call, self.requests, self.outputs = call, requests, outputs
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.kv, self.ledger = kv, kv.ledger
        self.kv_capacity_per_worker = self.ledger.num_pages * self.ledger.block_size
        self.watermark = max(1, self.ledger.num_pages // 100)   # pages kept free for running sequences to grow
        self.num_preemptions = 0
        self._step_outputs: list[StepOutput] | None = None    # collecting a decode step's outputs
        self._published: tuple | None = None
        self._published_at = 0.0
        self.waiting: deque[Request] = deque()
        self.preempted: deque[RunningSequence] = deque()        # to recompute, oldest first, before new requests
        self.running: list[RunningSequence] = []
        self.aborted: set[str] = set()
        self.next_seq_id = 0
        self.grammars: dict[TokenizerSource, GrammarBackend] = {}   # built at the first response_format

    def run(self) -> None:
        while True:
            self._publish_stats()
            if not self._poll(block=not (self.waiting or self.running or self.preempted)):
                return
            self._drop_aborted()
            if self.preempted and self._can_admit(self._tokens_to_recompute(self.preempted[0])):
                self._resume(self.preempted.popleft())
            elif not self.preempted and self.waiting and self._can_admit(len(self.waiting[0].prompt_token_ids)):
                self._prefill(self.waiting.popleft())
            elif self.running:
                self._decode()
            elif self.preempted or self.waiting:     # alone and still too large: refused up front, so never
                self._refuse_head()

    def _can_admit(self, num_tokens: int) -> bool:
        """First come, first served: the head waits for a batch slot and for its prompt's pages on every
        worker, leaving the watermark free while others run."""
        if len(self.running) >= self.max_num_seqs:
            return False
        keep = self.watermark if self.running else 0
        return all(need + keep <= free for need, free in zip(self.kv.prefill_pages(num_tokens),
                                                              self.ledger.free_pages()))

    def _refuse_head(self) -> None:
        """Nothing runs and the first waiting sequence still does not fit: LLM.submit refuses any request
        larger than an empty cache (check_fits), so this is a bug, said loudly rather than a silent hang."""
        seq_tokens = (self._tokens_to_recompute(self.preempted[0]) if self.preempted
                      else len(self.waiting[0].prompt_token_ids))
        raise RuntimeError(f"a sequence of {seq_tokens} tokens does not fit in the empty KV cache "
                           f"({self.ledger.free_pages()} free pages per worker); LLM.check_fits should have refused it")

    @staticmethod
    def _tokens_to_recompute(seq: RunningSequence) -> int:
        return len(seq.request.prompt_token_ids) + len(seq.generated)

    def _publish_stats(self) -> None:
        """Sends worker 0's figures when they change (at most every 0.25 s while busy)."""
        kv = self.ledger.tokens_per_worker()
        state = (len(self.running), len(self.waiting) + len(self.preempted), tuple(kv), self.num_preemptions)
        now = time.monotonic()
        if state == self._published or (now - self._published_at < 0.25 and self.running and
                                        state[:2] == self._published[:2]):
            return
        self._published, self._published_at = state, now
        self.outputs.put(("stats", {"running": state[0], "waiting": state[1], "kv_tokens_per_worker": kv,
                                    "kv_capacity_per_worker": self.kv_capacity_per_worker,
                                    "kv_pages_free": self.ledger.free_pages(), "num_preemptions": state[3]}))

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
        self.preempted = deque(s for s in self.preempted if s.request.request_id not in self.aborted)  # hold no pages
        gone = [s for s in self.running if s.request.request_id in self.aborted]
        if gone:
            self._free(gone)
            self.running = [s for s in self.running if s.request.request_id not in self.aborted]
        self.aborted.clear()

    def _prefill(self, request: Request) -> None:
        seq = RunningSequence(request, self.next_seq_id, make_generator(request.params, torch.device("cpu")),
                              grammar=self._grammar(request))
        self.next_seq_id += 1
        twin = self._running_twin(request)
        if twin is not None:   # the same prompt is already in the cache: copy its K/V instead of a prefill
            self.call("fork", twin.seq_id, seq.seq_id)
            logits, result = twin.prompt_logits, {"prefill_seconds": 0.0, "shared_prefill": True}
        else:
            called = time.perf_counter()
            result = self.call("prefill", seq.seq_id, torch.tensor(request.prompt_token_ids, dtype=torch.int64),
                               request.params.prompt_logprobs)
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
        return next((s for s in self.running if not s.aborted and not s.preemptions
                     and len(s.request.prompt_token_ids) == len(ids) and s.request.prompt_token_ids == ids), None)

    def _decode(self) -> None:
        batch = self._make_room(list(self.running))
        if not batch:
            return
        tokens = [s.generated[-1] for s in batch]
        positions = [len(s.request.prompt_token_ids) + len(s.generated) - 1 for s in batch]
        full_rows = [i for i, s in enumerate(batch) if s.needs_logits]
        greedy, logits = self.call("decode", [s.seq_id for s in batch], tokens, positions, full_rows)
        row_of = {i: j for j, i in enumerate(full_rows)}                          # batch index -> logits row
        constrained = [i for i in full_rows if batch[i].grammar is not None]
        masked = {}
        if constrained:   # a masked copy of those rows, in one call; logprobs still read the model's logits
            rows = mask_logits(logits[[row_of[i] for i in constrained]], [batch[i].grammar for i in constrained])
            masked = {i: rows[j] for j, i in enumerate(constrained)}
        self.running = []
        self._step_outputs = []           # sent as one message: one pickle and queue put per step, not per token
        for i, seq in enumerate(batch):
            if i in row_of:
                self._emit(seq, logits[row_of[i]], sample_logits=masked.get(i))
            else:
                self._commit(seq, greedy[i], None)
        outputs, self._step_outputs = self._step_outputs, None
        self.outputs.put(("outs", outputs))

    def _make_room(self, batch: list[RunningSequence]) -> list[RunningSequence]:
        """Preempts the newest sequences until this step's new pages fit on every worker; returns the rest."""
        while batch:
            need = self.ledger.step_new_pages([s.seq_id for s in batch])
            if all(n <= free for n, free in zip(need, self.ledger.free_pages())):
                return batch
            if len(batch) == 1:   # alone and out of pages: larger than the cache, which check_fits refuses
                raise RuntimeError(f"sequence {batch[0].seq_id} cannot grow in an otherwise empty KV cache")
            victim = max(batch, key=lambda s: (s.request.arrival_time, s.seq_id))
            batch.remove(victim)
            self.running.remove(victim)
            self._preempt(victim)
        return batch

    def _preempt(self, seq: RunningSequence) -> None:
        self.call("free", [seq.seq_id])
        seq.preemptions += 1
        self.num_preemptions += 1
        self.preempted.append(seq)
        self.preempted = deque(sorted(self.preempted, key=lambda s: (s.request.arrival_time, s.seq_id)))
        log.info("request %s preempted (KV cache full) after %d tokens; it will be recomputed",
                 seq.request.request_id, len(seq.generated))

    def _resume(self, seq: RunningSequence) -> None:
        """Recomputes a preempted sequence's cache (prompt + generated) and samples its next token."""
        ids = seq.request.prompt_token_ids + seq.generated
        result = self.call("prefill", seq.seq_id, torch.tensor(ids, dtype=torch.int64), None)
        self._emit(seq, result.pop("logits"))

    def _emit(self, seq: RunningSequence, logits: torch.Tensor, prefill: dict | None = None,
              keep_logits: bool = False, prompt_logprobs: list | None = None,
              sample_logits: torch.Tensor | None = None) -> None:
        """Samples from `sample_logits` (the grammar-masked logits) when given or when the sequence has
        a grammar, else from `logits`; the logprobs are always the model's own (unmasked) `logits`."""
        params = seq.request.params
        if sample_logits is None and seq.grammar is not None:
            sample_logits = mask_logits(logits.unsqueeze(0).clone(), [seq.grammar])[0]
        token = sample_one(logits if sample_logits is None else sample_logits, params, seq.generator)
        logprobs = token_logprobs(logits, token, params.logprobs) if params.logprobs is not None else None
        self._commit(seq, token, logprobs, prefill=prefill, logits=logits.clone() if keep_logits else None,
                     prompt_logprobs=prompt_logprobs)

    def _commit(self, seq: RunningSequence, token: int, logprobs: dict | None, prefill: dict | None = None,
                logits: torch.Tensor | None = None, prompt_logprobs: list | None = None) -> None:
        """Sends one sampled token back; the sequence runs on or is freed."""
        seq.generated.append(token)
        reason = self._finish_reason(seq, token)
        item = StepOutput(seq.request.request_id, token, logprobs, reason, time.time(), prefill=prefill,
                          logits=logits, prompt_logprobs=prompt_logprobs)
        if self._step_outputs is not None:
            self._step_outputs.append(item)
        else:
            self.outputs.put(("out", item))
        if reason is None:
            self.running.append(seq)
        else:
            self._free([seq])

    def _free(self, seqs: list[RunningSequence]) -> None:
        self.call("free", [s.seq_id for s in seqs])

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

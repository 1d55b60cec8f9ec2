"""Worker 0's loop: take requests in, plan a turn, carry it out, send each token back as soon as it exists.

One turn: `Policy.plan` (engine/step_plan.py) answers what runs now and how without changing anything (admit
the head of the queue as a copy of a twin, of a cached prefix or a prefill; resume a preempted sequence;
prefill a chunk; decode the running sequences; preempt; ...) with the prefix-cache entries to evict for its
pages; `carry_out` does it, asking the policy nothing more: evicts through the KV manager
(engine/cache/kv_manager.py), calls the workers (engine/calls.py; one message to the others a turn,
engine/dispatch.py), and absorbs what comes back (tokens sampled, sequences ended, chunks done). The step
diagram is in docs/design.md.

KV pages: a request is admitted when its prompt's pages fit on every worker (with a small watermark left
for the running sequences to grow); nothing is reserved for the tokens it may generate. When a decode
step needs more pages than a worker has free, the newest running sequence is preempted (engine/preemption.py)
and later resumed, before any new request: it takes back what its prefix-cache entry kept, or its prompt and
generated tokens are prefilled again (from the longest cached prefix, in chunks when longer than
--max-num-batched-tokens); a seeded request's noise depends only on its seed and the token's index
(engine/sampling.py), so a seeded or greedy request gives the same tokens as if it had never been preempted
(vLLM's recompute preemption).

Sampling: a decode step's tokens are drawn on worker 0's device for the whole batch (greedy,
temperature, top-k, top-p; logprobs there too); only the rows under a grammar (response_format)
come to the host, masked and sampled by the same rule."""
import logging
import queue
import time

import torch

from burstserve.engine import step_plan as plans
from burstserve.engine.cache.kv_manager import Hit, HostCopies, KVManager
from burstserve.engine.calls import Extend, ExtendAndDecode, Prefill, PrefillResult, PumpStores
from burstserve.engine.chunk_sizer import ChunkSizer, attention_flop_ratio, min_chunk_tokens
from burstserve.engine.config import EngineConfig, ModelConfig
from burstserve.engine.decode_steps import DecodeSteps
from burstserve.engine.dispatch import Dispatch
from burstserve.engine.inbox import Inbox
from burstserve.engine.messages import WorkerFacts
from burstserve.engine.outputs import FinishReason, PrefillStats, StepOutput
from burstserve.engine.preemption import Preemptions
from burstserve.engine.sequences import ChunkedPrefill, RunningSequence, SchedulerState, token_tensor
from burstserve.engine.stats_publisher import StatsPublisher
from burstserve.engine.token_outputs import TokenOutputs

log = logging.getLogger(__name__)
IDLE_PUMP_SECONDS = 0.002     # idle with host-tier stores queued: a slice is issued this often


class Scheduler:
    def __init__(self, call: Dispatch, requests: "queue.Queue", outputs: "queue.Queue", engine: EngineConfig,
                 cfg: ModelConfig, facts: WorkerFacts, max_model_len: int, eos_token_ids: list[int],
                 host_copies: HostCopies | None = None):
        """call: runs a call on every worker (engine/dispatch.py); facts: worker 0's (engine/messages.py; its
        device samples first tokens); host_copies: worker 0's host tier, asked whether its copies are done."""
        self.call, self.requests, self.outputs = call, requests, outputs
        device = torch.device(facts.device)
        self.tokens = TokenOutputs(outputs, device, eos_token_ids, max_model_len)
        self.kv = KVManager.of_workers(engine, facts, call, engine.enable_prefix_caching,
                                       host_copies)                                  # the cache's one ledger
        call.place = self.kv.place                                   # every work call placed before it runs
        chunk = engine.max_num_batched_tokens                        # None: a prompt is prefilled in one call
        target = engine.itl_target_ms
        self.sizer = ChunkSizer(chunk, target / 1e3 if target else None, attention_flop_ratio(cfg),
                                engine.page_size, min_chunk_tokens(device.type)) if chunk else None
        self.policy = plans.Policy(self.kv, engine.max_num_seqs, max_model_len, chunk, self.sizer,
                                   plans.mixed_batch_limit(engine, facts.mixed_graph_tokens), engine.async_scheduling)
        self.state = SchedulerState()
        self.inbox = Inbox(requests, self.state, self.kv)                  # engine/inbox.py
        self.preemptions = Preemptions(self.state, self.kv)     # engine/preemption.py
        self.next_seq_id = 0
        self.stats = StatsPublisher(outputs, self.kv)
        # late-bound: what wraps the scheduler's call, _commit or _emit (tests, profiles) wraps the decode steps' too
        self.decode = DecodeSteps(lambda message: self.call(message), self.state, self.tokens,
                                  lambda *a, **k: self._commit(*a, **k), lambda *a, **k: self._emit(*a, **k))
        self._carry_out = {plans.Admit: self._admit, plans.Resume: self._resume, plans.PrefillChunk: self._chunk,
                           plans.DecodeStep: self._decode, plans.StepAhead: self._decode_ahead,
                           plans.ReadBack: lambda plan: self.decode.drain(),
                           plans.Preempt: lambda plan: self.preemptions.newest(plan.seq),
                           plans.GiveWay: lambda plan: self.preemptions.give_way(), plans.Stuck: self._refuse,
                           plans.Idle: lambda plan: None}

    @property
    def prefix_cache(self):
        return self.kv.prefix_cache

    def run(self) -> None:
        while True:
            self.stats.publish(self.state, self.preemptions.count, self.preemptions.recomputed_tokens)
            pumping = not self.state.busy() and self.kv.stores_queued()
            if pumping:             # idle: the host tier's stores go out a slice a turn (a request that comes
                self.call(PumpStores())   # meanwhile waits behind one slice, not a whole store)
                time.sleep(IDLE_PUMP_SECONDS)
            idle = not self.state.busy() and not pumping
            if idle:
                self.call.flush()       # the cache's changes out to the other workers before the wait
            if not self.inbox.take(block=idle):
                self.decode.drain()
                return
            if self.state.inflight is None:           # a sequence in a step in flight is dropped after it
                self.inbox.drop_aborted()
            self.carry_out(self.policy.plan(self.state))

    def carry_out(self, plan) -> None:
        """Does what the plan says: its evictions first, then its calls, then what they return."""
        self.kv.evict(getattr(plan, "evict", ()))
        self._carry_out[type(plan)](plan)

    # admitting and resuming

    def _admit(self, plan: plans.Admit) -> None:
        """The head of the queue starts as the plan says: a copy of a running twin's prompt, a copy of a cached
        prefix, or a prefill. Beside a long prompt in chunks it is prefilled whole in this turn (then a decode
        step); otherwise in one call now, or (from a cached prefix, or chunked) in chunks from the next turn."""
        request = self.state.waiting.popleft()
        beside = self.state.prefilling is not None
        if beside:
            self.state.short_went_first = True     # then a chunk: short requests cannot starve the long one
        self.state.decode_owed = beside
        queued = time.time() - request.arrival_time
        seq = RunningSequence(request, self.next_seq_id, grammar=self.tokens.new_grammar(request))
        self.next_seq_id += 1
        if isinstance(plan.start, plans.CopyTwin):   # the same prompt is already in the cache: its K/V copied
            twin = plan.start.twin
            self.kv.fork(twin.seq_id, seq.seq_id)
            seq.prompt_logits = twin.prompt_logits
            self._emit(seq, twin.prompt_logits, prefill=PrefillStats(prefill_seconds=0.0, shared_prefill=True),
                       keep_logits=request.return_logits)
            return
        if request.params.prompt_logprobs is None:
            self.kv.count_query(request.prompt_token_ids)
        if plan.start is None and not plan.chunked:
            self._prefill_whole(seq, queued)
            return
        adopting = time.perf_counter()
        hit = self._copy_prefix(plan.start, seq)
        cached = hit.length if hit else 0
        job = ChunkedPrefill(seq, request.prompt_token_ids, done=cached, cached=cached,
                             host_cached=cached if hit and hit.on_host else 0,
                             adopt_seconds=time.perf_counter() - adopting, queued_seconds=queued)
        if beside:                  # a short prompt beside a long one: its rest in one call
            self._advance(job, job.remaining)
        else:
            self.state.prefilling = job

    def _copy_prefix(self, start, seq: RunningSequence) -> Hit | None:
        """A start FromPrefix: the cached prefix copied into the sequence's pages -> its Hit (else None)."""
        if not isinstance(start, plans.FromPrefix):
            return None
        self.kv.adopt(start.hit, seq.seq_id)
        return start.hit

    def _prefill_whole(self, seq: RunningSequence, queued: float) -> None:
        """The request's prompt prefilled in one call, its first token sampled."""
        request = seq.request
        called = time.perf_counter()
        result = self.call(Prefill(seq.seq_id, token_tensor(request.prompt_token_ids), request.params.prompt_logprobs))
        stats = result.stats()
        stats.call_seconds = time.perf_counter() - called   # the prefill call as worker 0's scheduler saw it
        stats.queued_seconds = queued
        self._observe(len(request.prompt_token_ids), 0, result)
        seq.prompt_logits = result.logits
        self._emit(seq, result.logits, prefill=stats, keep_logits=request.return_logits,
                   prompt_logprobs=result.prompt_logprobs)

    def _resume(self, plan: plans.Resume) -> None:
        """A preempted sequence decodes again as the plan says: on its kept pages (all of them: it decodes on;
        else its lost tail recomputed in chunks), or its cache (prompt + generated) recomputed as a prompt is
        prefilled, from a copy of a cached prefix or from nothing, then sampling its next token."""
        seq = self.state.preempted.popleft()
        self.state.decode_owed = False
        ids = seq.recompute_ids()
        kept = self.kv.kept(seq.seq_id)
        if isinstance(plan.start, plans.TakeBack):
            self.kv.reinstate(seq.seq_id)
            if kept == len(ids) - 1:
                self.state.running.append(seq)
                log.info("request %s resumed on its kept pages", seq.request.request_id)
                return
            cached = kept
        else:
            if kept:                          # what its entry kept gives way to a longer copy, or to nothing
                self.kv.drop(seq.seq_id)
            self.kv.count_query(ids)
            hit = self._copy_prefix(plan.start, seq)
            cached = hit.length if hit else 0
        self.preemptions.recomputed_tokens += len(ids) - cached
        log.info("request %s resumed: %d tokens to recompute, %d of them found in the prefix cache",
                 seq.request.request_id, len(ids), cached)
        if cached or plan.chunked:            # in chunks, from the next turn
            self.state.prefilling = ChunkedPrefill(seq, ids, done=cached, cached=cached)
            return
        result = self.call(Prefill(seq.seq_id, token_tensor(ids)))
        self._observe(len(ids), 0, result)
        self._emit(seq, result.logits)

    # chunks

    def _chunk(self, plan: plans.PrefillChunk) -> None:
        """The prompt's next chunk (with plan.decode: and their decode step in the same call)."""
        self.state.short_went_first = False
        self.state.decode_owed = plan.decode is None
        if self._advance(self.state.prefilling, plan.tokens, plan.decode):
            self.state.prefilling = None

    def _advance(self, job: ChunkedPrefill, n: int, decode: list[RunningSequence] | None = None) -> bool:
        """Prefills the job's next n prompt tokens: the first chunk as a prefill, the others as an
        incremental prefill over the tokens before them (with `decode`: and a decode step of those running
        sequences in the same call); after the last, samples its first token -> done?"""
        ids = job.tokens
        chunk = token_tensor(ids[job.done:job.done + n])
        called = time.perf_counter()
        if job.done == 0:                     # nothing cached: the first chunk is a prefill
            result = self.call(Prefill(job.seq.seq_id, chunk))
        elif decode is None:
            result = self.call(Extend(job.seq.seq_id, chunk, job.done))
        else:
            step = self.decode.call_for(decode)
            result = self.call(ExtendAndDecode(Extend(job.seq.seq_id, chunk, job.done), step))
            self.decode.finish(decode, step.host_rows, result.decode)   # before the prompt joins the running
        job.call_seconds += time.perf_counter() - called
        if log.isEnabledFor(logging.DEBUG) and self.sizer is not None and self.sizer.calls:
            log.debug("chunk of %d tokens after %d (%s): %.1f ms (predicted %.1f), last decode step %.1f ms", n,
                      job.done, result.extend_way or "prefill", result.prefill_seconds * 1e3,
                      self.sizer.predict(n, job.done) * 1e3, self.state.step_seconds * 1e3)
        self._observe(n, job.done, result)
        job.count(n, result, mixed=decode is not None)
        if job.done < len(ids):
            return False
        logits = result.logits
        if job.resumed:                       # its cache is whole again: it samples on, no first-token stats
            self._emit(job.seq, logits)
            return True
        job.seq.prompt_logits = logits
        self._emit(job.seq, logits, prefill=job.prompt_stats(result), keep_logits=job.seq.request.return_logits)
        return True

    def _observe(self, new_tokens: int, context: int, result: PrefillResult) -> None:
        """A prefill or extend call's time, for the chunk sizer's cost model."""
        if self.sizer is not None:
            self.sizer.observe(new_tokens, context, result.prefill_seconds)

    # decoding

    def _decode(self, plan: plans.DecodeStep) -> None:
        self.state.decode_owed = False
        if plan.ahead:
            self.state.inflight = self.decode.launch(plan.batch, None)   # read back by the next StepAhead, or drain
        else:
            self.decode.run(plan.batch)

    def _decode_ahead(self, plan: plans.StepAhead) -> None:
        """Asynchronous scheduling: the next step launched, then the one in flight read back (DecodeSteps)."""
        self.decode.ahead(plan.batch, plan.rows)

    @staticmethod
    def _refuse(plan: plans.Stuck) -> None:
        raise RuntimeError(plan.why)

    # tokens

    def _emit(self, seq: RunningSequence, logits: torch.Tensor, prefill: PrefillStats | None = None,
              keep_logits: bool = False, prompt_logprobs: list | None = None,
              sample_logits: torch.Tensor | None = None) -> None:
        """The sequence's next token sampled from `logits` [V] (TokenOutputs.sample: `sample_logits`, the
        grammar-masked logits, when given), then committed."""
        token, logprobs = self.tokens.sample(seq, logits, sample_logits)
        self._commit(seq, token, logprobs, prefill=prefill, logits=logits.clone() if keep_logits else None,
                     prompt_logprobs=prompt_logprobs)

    def _commit(self, seq: RunningSequence, token: int, logprobs: dict | None, prefill: PrefillStats | None = None,
                logits: torch.Tensor | None = None, prompt_logprobs: list | None = None,
                token_computed: bool = False) -> None:
        """Sends one sampled token back; the sequence runs on or is freed (token_computed: a step in flight
        computes this token's K/V, kept with the cache when it ends)."""
        seq.generated.append(token)
        reason = self.tokens.accept(seq, token)
        self.tokens.send(StepOutput(seq.request.request_id, token, logprobs, reason, time.time(), prefill=prefill,
                                    logits=logits, prompt_logprobs=prompt_logprobs))
        if reason is None:
            self.state.running.append(seq)
        elif self.kv.prefix_cache is not None and reason != FinishReason.ABORT:
            computed = seq.generated if token_computed else seq.generated[:-1]                   # K/V computed
            self.kv.retire(seq.seq_id, seq.request.prompt_token_ids + computed)
        else:
            self.kv.free([seq.seq_id])

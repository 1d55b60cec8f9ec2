"""Worker 0's loop: take requests in, plan a turn, carry it out, send each token back as soon as it exists.

One turn: `Policy.plan` (engine/scheduler/step_plan.py) answers what runs now and how without changing anything (admit
the head of the queue as a copy of a twin, of a cached prefix or a prefill; resume a preempted sequence;
prefill a chunk; decode the running sequences; preempt; ...) with the prefix-cache entries to evict for its
pages; `carry_out` does it, asking the policy nothing more: evicts through the KV manager
(engine/cache/kv_manager.py), calls the workers (engine/core/calls.py; one message to the others a turn,
engine/scheduler/dispatch.py), and hands what comes back to `update` as a StepResult (engine/scheduler/step_result.py): the one
place results change the scheduler's state (tokens sampled and committed, sequences ended, chunks counted,
the chunked prompt done). The step diagram is in docs/design.md.

KV pages: a request is admitted when its prompt's pages fit on every worker (with a small watermark left
for the running sequences to grow); nothing is reserved for the tokens it may generate. When a decode
step needs more pages than a worker has free, the newest running sequence is preempted (engine/scheduler/preemption.py)
and later resumed, before any new request: it takes back what its prefix-cache entry kept, or its prompt and
generated tokens are prefilled again (from the longest cached prefix, in chunks when longer than
--max-num-batched-tokens); a seeded request's noise depends only on its seed and the token's index
(engine/core/sampling.py), so a seeded or greedy request gives the same tokens as if it had never been preempted
(vLLM's recompute preemption).

Sampling: a decode step's tokens are drawn on worker 0's device for the whole batch (greedy,
temperature, top-k, top-p; logprobs there too); only the rows under a grammar (response_format)
come to the host, masked and sampled by the same rule."""
import logging
import queue
import time

import torch

from burstserve.engine.cache.kv_manager import Hit, HostCopies, KVManager
from burstserve.engine.core.calls import Extend, ExtendAndDecode, Prefill, PumpStores
from burstserve.engine.core.messages import WorkerFacts
from burstserve.engine.core.outputs import FinishReason, PrefillStats, StepOutput
from burstserve.engine.model.config import EngineConfig, ModelConfig
from burstserve.engine.scheduler import step_plan as plans
from burstserve.engine.scheduler.chunk_sizer import ChunkSizer, attention_flop_ratio, min_chunk_tokens
from burstserve.engine.scheduler.decode_steps import DecodeSteps
from burstserve.engine.scheduler.dispatch import Dispatch
from burstserve.engine.scheduler.inbox import Inbox
from burstserve.engine.scheduler.preemption import Preemptions
from burstserve.engine.scheduler.prompt_results import PromptResults
from burstserve.engine.scheduler.sequences import ChunkedPrefill, RunningSequence, SchedulerState, token_tensor
from burstserve.engine.scheduler.stats_publisher import StatsPublisher
from burstserve.engine.scheduler.step_result import DecodeWork, PromptWork, StepResult
from burstserve.engine.scheduler.token_outputs import TokenOutputs

log = logging.getLogger(__name__)
IDLE_PUMP_SECONDS = 0.002     # idle with host-tier stores queued: a slice is issued this often


class Scheduler:
    def __init__(self, call: Dispatch, requests: "queue.Queue", outputs: "queue.Queue", engine: EngineConfig,
                 cfg: ModelConfig, facts: WorkerFacts, max_model_len: int, eos_token_ids: list[int],
                 host_copies: HostCopies | None = None):
        """call: runs a call on every worker (engine/scheduler/dispatch.py); facts: worker 0's (engine/core/messages.py; its
        device samples first tokens); host_copies: worker 0's host tier, asked whether its copies are done."""
        self.call, self.requests, self.outputs = call, requests, outputs
        device = torch.device(facts.device)
        self.tokens = TokenOutputs(outputs, device, eos_token_ids, max_model_len)
        self.kv = KVManager.of_workers(engine, facts, call, engine.enable_prefix_caching,
                                       host_copies)                                  # the cache's one ledger
        chunk = engine.max_num_batched_tokens                        # None: a prompt is prefilled in one call
        target = engine.itl_target_ms
        self.sizer = ChunkSizer(chunk, target / 1e3 if target else None, attention_flop_ratio(cfg),
                                engine.page_size, min_chunk_tokens(device.type)) if chunk else None
        self.policy = plans.Policy(self.kv, engine.max_num_seqs, max_model_len, chunk, self.sizer,
                                   plans.mixed_batch_limit(engine, facts.mixed_graph_tokens), engine.async_scheduling)
        self.state = SchedulerState()
        self.inbox = Inbox(requests, self.state, self.kv)                  # engine/scheduler/inbox.py
        self.preemptions = Preemptions(self.state, self.kv)     # engine/scheduler/preemption.py
        self.next_seq_id = 0
        self.stats = StatsPublisher(outputs, self.kv)
        # late-bound: what wraps the scheduler's call, _commit or _emit (tests, profiles) wraps the decode steps' too
        self.decode = DecodeSteps(lambda work: self._run(work), self.state, self.tokens,
                                  lambda *a, **k: self._commit(*a, **k), lambda *a, **k: self._emit(*a, **k))
        self.prompts = PromptResults(self.state, self.sizer, lambda *a, **k: self._emit(*a, **k))
        self._carry_out = {plans.Admit: self._admit, plans.Resume: self._resume, plans.PrefillChunk: self._chunk,
                           plans.DecodeStep: self._decode, plans.StepAhead: self._decode_ahead,
                           plans.ReadBack: lambda plan: self._read_back(),
                           plans.Preempt: lambda plan: self.preemptions.newest(plan.seq),
                           plans.GiveWay: lambda plan: self.preemptions.give_way(), plans.Stuck: self._refuse,
                           plans.Idle: lambda plan: None}

    def _run(self, work):
        """A work call (a prefill, an extend, a decode step) placed by the KV manager (its tokens' workers and
        pages, recorded in the ledger), then run on every worker -> worker 0's result."""
        return self.call(self.kv.place(work))

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
                self._read_back()
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
            self.update(StepResult(PromptWork(seq, 0, 0, twin_logits=twin.prompt_logits)))
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
        work = PromptWork(seq, len(request.prompt_token_ids), 0, queued=queued, called=time.perf_counter())
        result = self._run(Prefill(seq.seq_id, token_tensor(request.prompt_token_ids), request.params.prompt_logprobs))
        self.update(StepResult(work, result))

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
        work = PromptWork(seq, len(ids), 0, resumed=True)
        self.update(StepResult(work, self._run(Prefill(seq.seq_id, token_tensor(ids)))))

    # chunks

    def _chunk(self, plan: plans.PrefillChunk) -> None:
        """The prompt's next chunk (with plan.decode: and their decode step in the same call)."""
        self.state.short_went_first = False
        self.state.decode_owed = plan.decode is None
        self._advance(self.state.prefilling, plan.tokens, plan.decode)

    def _advance(self, job: ChunkedPrefill, n: int, decode: list[RunningSequence] | None = None) -> None:
        """Prefills the job's next n prompt tokens: the first chunk as a prefill, the others as an
        incremental prefill over the tokens before them (with `decode`: and a decode step of those running
        sequences in the same call); update samples its first token after the last."""
        ids = job.tokens
        chunk = token_tensor(ids[job.done:job.done + n])
        work = PromptWork(job.seq, n, job.done, job=job, called=time.perf_counter())
        if job.done == 0:                     # nothing cached: the first chunk is a prefill
            self.update(StepResult(work, self._run(Prefill(job.seq.seq_id, chunk))))
        elif decode is None:
            self.update(StepResult(work, self._run(Extend(job.seq.seq_id, chunk, job.done))))
        else:
            step = self.decode.call_for(decode)
            result = self._run(ExtendAndDecode(Extend(job.seq.seq_id, chunk, job.done), step))
            self.update(StepResult(work, result, DecodeWork(decode, step.host_rows, result.decode)))

    # the one place a turn's results change the scheduler's state

    def update(self, result: StepResult) -> None:
        """Applies what a turn's work returned: a decode step's tokens (each committed: the sequence runs on or
        ends), a step launched ahead read back, a prompt's call (a chunk counted; its first token sampled when
        it is whole, the chunked prompt done)."""
        if result.decode is not None:                # before a prompt in the same call joins the running
            step = result.decode
            self.decode.finish(step.batch, step.host_rows, step.result)
        if result.read_back is not None:
            self.decode.collect(result.read_back)
        if result.prompt is not None:
            self.prompts.apply(result.prompt, result.prefill, mixed=result.decode is not None)

    # decoding

    def _decode(self, plan: plans.DecodeStep) -> None:
        self.state.decode_owed = False
        if plan.ahead:
            self.state.inflight = self.decode.launch(plan.batch, None)   # read back by the next StepAhead, or drain
        else:
            self.update(StepResult(decode=self.decode.run(plan.batch)))

    def _decode_ahead(self, plan: plans.StepAhead) -> None:
        """Asynchronous scheduling: the next step launched, then the one in flight read back (DecodeSteps)."""
        self.update(StepResult(read_back=self.decode.ahead(plan.batch, plan.rows)))

    def _read_back(self) -> None:
        """The step in flight, if any, read back (before anything but another decode step)."""
        step = self.decode.drain()
        if step is not None:
            self.update(StepResult(read_back=step))

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

"""Worker 0's loop: take requests in, plan a turn, run it, send each token back as soon as it exists.

One turn, three steps (as vLLM v1 and nano-vllm shape theirs; the diagram is in docs/design.md):
- `schedule() -> StepPlan` (engine/scheduler/step.py). The policy (engine/scheduler/policy.py) picks the next
  move without changing anything (admit the head of the queue as a copy of a twin, of a cached prefix or a
  prefill; resume a preempted sequence; prefill a chunk; decode the running sequences; preempt; ...) with the
  prefix-cache entries to evict for its pages. `schedule` makes it a StepPlan, asking the policy nothing more:
  the evictions done, the queues moved as the move says (a request admitted, a sequence resumed or
  preempted), and the turn's work call placed by the KV manager (engine/cache/kv_manager.py): its pages taken
  in the ledger. The cache's changes (evictions, copies, frees) run on worker 0's pool as they are made and go
  to the others with the work (engine/scheduler/dispatch.py).
- `execute(StepPlan) -> StepResult`: the work run on every worker, worker 0 included, through one entry point
  (ModelRunner.execute; one message to the others), and the host tier's progress after it.
- `update(StepResult)`: the one place results change the scheduler's state: tokens sampled and committed,
  sequences ended, chunks counted, the chunked prompt done, the host tier's progress handed to the KV manager.

KV pages: a request is admitted when its prompt's pages fit on every worker (with a small watermark left for the
running sequences to grow); nothing is reserved for the tokens it may generate. When a decode step needs more
pages than a worker has free, the newest running sequence is preempted (engine/scheduler/preemption.py) and later
resumed, before any new request: it takes back what its prefix-cache entry kept, or its prompt and generated
tokens are prefilled again (from the longest cached prefix, in chunks when longer than --max-num-batched-tokens);
a seeded request's noise depends only on its seed and the token's index (engine/core/sampling.py), so a seeded or
greedy request gives the same tokens as if never preempted (vLLM's recompute preemption).

Sampling: one path for every token, on worker 0's device where the logits are (engine/runner/step_tokens.py):
a decode step's tokens for the whole batch and a prompt's next token (greedy, temperature, top-k, top-p;
logprobs there too). Only the rows under a grammar (response_format) come to the host, masked and drawn by
the same rule (engine/scheduler/token_outputs.py), as does a twin's first token from its twin's kept logits."""
import logging
import queue
import time

import torch

from burstserve.engine.cache.kv_manager import Hit, KVManager
from burstserve.engine.core.calls import Decode, Extend, ExtendAndDecode, Prefill, PumpStores, SampleNext
from burstserve.engine.core.messages import WorkerFacts
from burstserve.engine.core.outputs import FinishReason, PrefillStats, StepOutput
from burstserve.engine.model.config import EngineConfig, ModelConfig
from burstserve.engine.scheduler import policy as plans
from burstserve.engine.scheduler.chunk_sizer import ChunkSizer, attention_flop_ratio, min_chunk_tokens
from burstserve.engine.scheduler.decode_steps import DecodeSteps
from burstserve.engine.scheduler.dispatch import Dispatch
from burstserve.engine.scheduler.inbox import Inbox
from burstserve.engine.scheduler.preemption import Preemptions
from burstserve.engine.scheduler.prompt_results import PromptResults
from burstserve.engine.scheduler.sequences import ChunkedPrefill, RunningSequence, SchedulerState, token_tensor
from burstserve.engine.scheduler.stats_publisher import StatsPublisher
from burstserve.engine.scheduler.step import PromptWork, StepPlan, StepResult
from burstserve.engine.scheduler.token_outputs import TokenOutputs

log = logging.getLogger(__name__)
IDLE_PUMP_SECONDS = 0.002     # idle with host-tier stores queued: a slice is issued this often


class Scheduler:
    def __init__(self, call: Dispatch, requests: "queue.Queue", outputs: "queue.Queue", engine: EngineConfig,
                 cfg: ModelConfig, facts: WorkerFacts, max_model_len: int, eos_token_ids: list[int]):
        """call: runs a call on every worker (engine/scheduler/dispatch.py); facts: worker 0's (engine/core/messages.py;
        its device samples a grammar's tokens)."""
        self.call, self.requests, self.outputs = call, requests, outputs
        device = torch.device(facts.device)
        self.tokens = TokenOutputs(outputs, device, eos_token_ids, max_model_len)
        self.kv = KVManager.of_workers(engine, facts, call, engine.enable_prefix_caching)   # the cache's one ledger
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
        # late-bound: what wraps the scheduler's _commit or _emit (tests, profiles) wraps the decode steps' too
        self.decode = DecodeSteps(self.state, self.tokens, lambda *a, **k: self._commit(*a, **k),
                                  lambda *a, **k: self._emit(*a, **k))
        self.prompts = PromptResults(self.state, self.sizer, lambda *a, **k: self._commit(*a, **k),
                                     lambda *a, **k: self._emit(*a, **k))
        self._plan_of = {plans.Admit: self._admit, plans.Resume: self._resume, plans.PrefillChunk: self._chunk,
                         plans.DecodeStep: self._decode, plans.StepAhead: self._decode_ahead,
                         plans.ReadBack: lambda move: StepPlan(read_back=self.decode.drain()),
                         plans.Preempt: lambda move: self._no_work(self.preemptions.newest, move.seq),
                         plans.GiveWay: lambda move: self._no_work(self.preemptions.give_way),
                         plans.Stuck: self._refuse, plans.Idle: lambda move: StepPlan()}

    def run(self) -> None:
        while True:
            self.stats.publish(self.state, self.preemptions.count, self.preemptions.recomputed_tokens)
            pumping = not self.state.busy() and self.kv.copies.stores_queued()
            if pumping:             # idle: the host tier's stores go out a slice a turn (a request that comes
                self.update(self.execute(StepPlan(PumpStores())))   # meanwhile waits behind one slice, not a whole store)
                time.sleep(IDLE_PUMP_SECONDS)
            idle = not self.state.busy() and not pumping
            if idle:
                self.call.flush()       # the cache's changes out to the other workers before the wait
            if not self.inbox.take(block=idle):
                self.update(self.execute(StepPlan(read_back=self.decode.drain())))   # the step in flight, if any
                return
            if self.state.inflight is None:           # a sequence in a step in flight is dropped after it
                self.inbox.drop_aborted()
            self.update(self.execute(self.schedule()))

    # the turn

    def schedule(self) -> StepPlan:
        """The policy's next move, made into this turn's StepPlan (`plan_of`)."""
        return self.plan_of(self.policy.plan(self.state))

    def plan_of(self, move) -> StepPlan:
        """A move of the policy (engine/scheduler/policy.py) made into a StepPlan, asking the policy nothing more:
        its evictions first, then the queues moved as it says and its work call placed (its pages taken)."""
        self.kv.evict(getattr(move, "evict", ()))
        return self._plan_of[type(move)](move)

    def execute(self, plan: StepPlan) -> StepResult:
        """The plan's work run on every worker (engine/scheduler/dispatch.py) -> what worker 0's returned, the
        call's time, and the host tier's progress after it."""
        called = time.perf_counter()
        result = self.call(plan.work) if plan.work is not None else None
        return StepResult(plan, result, called, time.perf_counter() - called, self.call.host)

    def update(self, result: StepResult) -> None:
        """Applies what a turn returned: the host tier's progress, a decode step's tokens (each committed: the
        sequence runs on or ends), a step launched ahead put in flight and the one before read back, a
        prompt's call (a chunk counted; its first token sampled when it is whole, the chunked prompt done)."""
        plan = result.plan
        self.kv.copies.report(result.host)
        if plan.decode is not None:                  # before a prompt in the same call joins the running
            step = plan.work.decode if isinstance(plan.work, ExtendAndDecode) else plan.work
            if isinstance(plan.work, Decode):
                self.state.step_seconds = result.seconds
            self.decode.finish(plan.decode, step.host_rows, result.decoded)
        if plan.launch is not None:
            self.decode.launched(plan.launch, result.result, plan.work.fed_from is not None, result.called)
        if plan.read_back is not None:
            self.decode.collect(plan.read_back)
        if plan.prompt is not None:
            self.prompts.apply(plan.prompt, result.prefill, result.called, mixed=plan.decode is not None)

    def _no_work(self, move, *args) -> StepPlan:
        """A move that only changes the queues and the cache (a preemption, a prompt giving way)."""
        move(*args)
        return StepPlan()

    # admitting and resuming

    def _admit(self, plan: plans.Admit) -> StepPlan:
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
            return StepPlan(prompt=PromptWork(seq, 0, 0, twin_logits=twin.prompt_logits))
        if request.params.prompt_logprobs is None:
            self.kv.count_query(request.prompt_token_ids)
        if plan.start is None and not plan.chunked:                # the prompt in one call
            ids = request.prompt_token_ids
            prefill = Prefill(seq.seq_id, token_tensor(ids), request.params.prompt_logprobs,
                              sample_next=self._sample_next(seq))
            return StepPlan(self.kv.place(prefill), PromptWork(seq, len(ids), 0, queued=queued))
        adopting = time.perf_counter()
        hit = self._copy_prefix(plan.start, seq)
        cached = hit.length if hit else 0
        job = ChunkedPrefill(seq, request.prompt_token_ids, done=cached, cached=cached,
                             host_cached=cached if hit and hit.on_host else 0,
                             adopt_seconds=time.perf_counter() - adopting, queued_seconds=queued)
        if beside:                  # a short prompt beside a long one: its rest in one call
            return self._advance(job, job.remaining)
        self.state.prefilling = job
        return StepPlan()

    def _copy_prefix(self, start, seq: RunningSequence) -> Hit | None:
        """A start FromPrefix: the cached prefix copied into the sequence's pages -> its Hit (else None)."""
        if not isinstance(start, plans.FromPrefix):
            return None
        self.kv.adopt(start.hit, seq.seq_id)
        return start.hit

    def _resume(self, plan: plans.Resume) -> StepPlan:
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
                return StepPlan()
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
            return StepPlan()
        prefill = Prefill(seq.seq_id, token_tensor(ids), sample_next=self._sample_next(seq, resumed=True))
        return StepPlan(self.kv.place(prefill), PromptWork(seq, len(ids), 0, resumed=True))

    # chunks

    def _chunk(self, plan: plans.PrefillChunk) -> StepPlan:
        """The prompt's next chunk (with plan.decode: and their decode step in the same call)."""
        self.state.short_went_first = False
        self.state.decode_owed = plan.decode is None
        return self._advance(self.state.prefilling, plan.tokens, plan.decode)

    def _advance(self, job: ChunkedPrefill, n: int, decode: list[RunningSequence] | None = None) -> StepPlan:
        """The job's next n prompt tokens: the first chunk as a prefill, the others as an incremental prefill
        over the tokens before them (with `decode`: and a decode step of those running sequences in the same
        call); update samples its first token after the last."""
        ids = job.tokens
        chunk = token_tensor(ids[job.done:job.done + n])
        work = PromptWork(job.seq, n, job.done, job=job)
        sample = self._sample_next(job.seq, job.resumed) if job.done + n == len(ids) else None   # the last chunk
        if job.done == 0:                     # nothing cached: the first chunk is a prefill
            return StepPlan(self.kv.place(Prefill(job.seq.seq_id, chunk, sample_next=sample)), work)
        extend = Extend(job.seq.seq_id, chunk, job.done, sample_next=sample)
        if decode is None:
            return StepPlan(self.kv.place(extend), work)
        mixed = ExtendAndDecode(extend, self.decode.call_for(decode))
        return StepPlan(self.kv.place(mixed), work, decode=decode)

    @staticmethod
    def _sample_next(seq: RunningSequence, resumed: bool = False) -> SampleNext:
        """How worker 0 draws the token after the sequence's prompt: on its device by the sequence's rule (a
        grammar's row on the host); a request's first token with the logits back too, kept for a twin (the same
        prompt admitted while it runs: one request's n choices) to draw its own first token from."""
        return SampleNext(seq.sampling(), on_host=seq.grammar is not None, logits=not resumed)

    # decoding

    def _decode(self, plan: plans.DecodeStep) -> StepPlan:
        """A step of the batch: read back in this turn, or (`ahead`) launched and read back by a later one."""
        self.state.decode_owed = False
        if plan.ahead:
            return StepPlan(self.kv.place(self.decode.launch_call(plan.batch, None)), launch=plan.batch)
        return StepPlan(self.kv.place(self.decode.call_for(plan.batch)), decode=plan.batch)

    def _decode_ahead(self, plan: plans.StepAhead) -> StepPlan:
        """Asynchronous scheduling: the next step launched (if any), then the one in flight read back."""
        in_flight = self.decode.drain()
        if not plan.batch:
            return StepPlan(read_back=in_flight)
        launch = self.kv.place(self.decode.launch_call(plan.batch, plan.rows))
        return StepPlan(launch, launch=plan.batch, read_back=in_flight)

    @staticmethod
    def _refuse(plan: plans.Stuck) -> StepPlan:
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

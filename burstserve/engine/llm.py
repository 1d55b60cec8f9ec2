"""The offline API: `LLM(model=..., devices=..., context_parallel_size=...)` and
`llm.generate(prompts, SamplingParams(...))`.

`LLM` validates everything it can before starting workers, spawns one worker process per device,
routes each token that worker 0 sends back to its request, and raises (never hangs) if a worker
dies. The HTTP server uses the same object through `submit` / `results`.
"""
import atexit
import dataclasses
import gc
import itertools
import logging
import queue
import socket
import threading
import time
from typing import Callable, Iterator

import torch
import torch.multiprocessing as mp

from burstserve.engine.cluster import Head
from burstserve.engine.control import close_parent_ends, make_pipes
from burstserve.engine.core.devices import resolve_devices
from burstserve.engine.core.errors import DeviceSpecError, EngineDeadError, InvalidRequestError, ModelLoadError
from burstserve.engine.core.messages import (AbortRequest, AddRequest, EngineFigures, EngineStats, StopScheduler, Tokens,
                                        WorkerFacts, WorkerFailed, WorkerReady)
from burstserve.engine.core.outputs import Request, RequestOutput, StepOutput, request_output
from burstserve.engine.core.sampling import SamplingParams
from burstserve.engine.core.structured_output import StructuredRequest
from burstserve.engine.core.tokenizer import load_tokenizer
from burstserve.engine.model.config import EngineConfig, context_limit, resolve_model
from burstserve.engine.model.gguf import converted_checkpoint, gguf_file, packaged_model
from burstserve.engine.model.weights import weight_files
from burstserve.engine.options import check_options, chunk_tokens, cluster_config, engine_config, with_options
from burstserve.engine.pages.host_memory import offload_gib
from burstserve.engine.parallel import STRATEGIES, get_strategy, window_refusal
from burstserve.engine.request_checks import Prompt, RequestChecks, prompt_list
from burstserve.engine.worker import spawned_worker_main
from burstserve.kernels.attention import backend_refusal
from burstserve.kernels.fp8 import quantization_refusal
from burstserve.kernels.kv_quant import kv_cache_refusal

log = logging.getLogger(__name__)


class LLM:
    """A model served by `context_parallel_size` worker processes on the devices `devices` names.

    Every keyword but `model` is an engine option: engine/options.py OPTIONS has each one's type, default,
    help (the CLI's: `burstserve serve --help`) and check; a refused value raises InvalidRequestError
    naming it. Among them:
    devices: as torch names them: "cpu" (or "cpu:0"), "cuda" (every visible GPU), "cuda:1" (GPU 1),
        "cuda:0,2" (GPUs 0 and 2); default: every visible GPU, else "cpu".
    context_parallel_size: how many workers split each prompt; default: every named GPU, or 1 on CPU.
        On CUDA a smaller size takes the first N named GPUs; on CPU the N workers all run on "cpu" (gloo).
    attention_backend: auto (flash-attn-4 on SM90+ when installed, then cuDNN, PyTorch's FA2), or one of
        flash-attn, cudnn, flash, reference.
    enable_chunked_prefill, max_num_batched_tokens: a prompt longer than max_num_batched_tokens (default
        engine/model/config.py default_chunk_tokens: 65536, 131072 on two workers or more) is prefilled in chunks,
        the running sequences decoding between them,
        and a shorter one too while others decode when one call would hold them past itl_target_ms;
        enable_chunked_prefill=False prefills every prompt in one call.
    nnodes, master_addr, master_port, join_timeout: with nnodes > 1 this is the head of an engine over
        several hosts (engine/cluster.py): it keeps the rendezvous at master_addr:master_port, waits up to
        join_timeout seconds for node ranks 1 .. nnodes - 1 (`burstserve worker`) and runs their workers
        after its own (ranks host-major). Raises ClusterError when a host does not join.
    Raises DeviceSpecError (before any worker starts) when the machine cannot satisfy them.
    """

    @with_options
    def __init__(self, model: str = "tiny", **options):
        values = check_options(options)
        self.cluster = cluster_config(values)
        self.engine = _engine_config(model, values, self.cluster.nnodes)
        self.model_config, self.max_model_len = resolve_model(self.engine)
        if not self.engine.is_preset:
            weight_files(self.engine.model)      # fails now, naming the file, rather than in every worker
            made_for = context_limit(self.model_config)
            if self.max_model_len > made_for:
                log.warning("max_model_len %d is longer than the %d tokens %s is made for (its config's "
                            "max_position_embeddings, or for YaRN its pretraining length x factor): positions "
                            "past that are outside its training, and its outputs there may be wrong",
                            self.max_model_len, made_for, model)
        self.tokenizer = load_tokenizer(self.engine.model, self.engine.is_preset)
        self._local_workers = self.engine.world_size
        self._head = Head(self.cluster) if self.cluster.nnodes > 1 else None
        if self._head is not None:       # the other hosts' workers join the engine (engine/cluster.py)
            self.engine = self._head.gather(self.engine)
            self.engine = dataclasses.replace(self.engine, max_num_batched_tokens=chunk_tokens(
                values, self.engine.world_size))        # the default chunk grows with every host's workers
        strategy = get_strategy(self.engine.sp_strategy, self.engine.world_size)
        reason = window_refusal(self.model_config, strategy) or strategy.model_refusal(self.model_config)
        if self._head is not None and reason:
            self._head.abort(reason)
        elif self._head is not None:
            self._head.publish(self.engine)
        if reason:
            raise InvalidRequestError(reason, "sp_strategy")
        self._ids = itertools.count()
        self._results: dict[str, Callable[[object], None]] = {}   # request id -> where its outputs go
        self._queues: dict[str, queue.Queue] = {}
        self.stats = EngineFigures()                               # worker 0's latest scheduler figures
        self._arrivals: dict[str, float] = {}
        self._dead: str | None = None
        self._closed = False
        self.worker_facts: list[WorkerFacts] = []                # by rank, as each reported at start
        self._start_workers()
        atexit.register(self.shutdown)

    # ---- public API -------------------------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order; a prompt is a string or a list of token ids."""
        prompts = prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} sampling params", "sampling_params")
        encoded = [self.encode(p) for p in prompts]                       # validate all before any work
        for e, p in zip(encoded, params):
            self.checks.fits(len(e), p.max_tokens)
            self.checks.one_call(len(e), p)
            self.checks.structured(p)
        ids = [self.submit(e, p) for e, p in zip(encoded, params)]
        return [self._collect(rid, prompt, e) for rid, prompt, e in zip(ids, prompts, encoded)]

    def next_token_logits(self, prompt: Prompt) -> torch.Tensor:
        """The model's next-token logits [V] (fp32) after a prompt: one prefill."""
        encoded = self.encode(prompt)
        rid = self.submit(encoded, SamplingParams(temperature=0, max_tokens=1), return_logits=True)
        return self._collect(rid, None, encoded).prompt_logits

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, checked against the vocabulary and max_model_len."""
        return self.checks.encode(prompt)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raises InvalidRequestError when a request could never fit in the KV cache, even alone."""
        self.checks.fits(prompt_tokens, max_tokens)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
               return_logits: bool = False, sink: Callable[[object], None] | None = None) -> str:
        """Queues one encoded prompt. Its StepOutputs (or an EngineDeadError) are passed to `sink`
        from the engine's router thread; without a sink they are read with `results(request_id)`."""
        self._check_alive()
        self.checks.fits(len(prompt_token_ids), params.max_tokens)
        self.checks.one_call(len(prompt_token_ids), params)
        structured = self.checks.structured(params)          # raises before any work on a bad response_format
        request_id = request_id or f"req-{next(self._ids)}"
        if sink is None:
            q = queue.Queue()
            self._queues[request_id] = q
            sink = q.put
        self._results[request_id] = sink
        self._arrivals[request_id] = time.time()
        self._requests.put(AddRequest(Request(request_id, prompt_token_ids, params, time.time(), return_logits,
                                              structured)))
        return request_id

    def structured_request(self, params: SamplingParams) -> StructuredRequest | None:
        """What worker 0 needs to constrain a request to its response_format (None: unconstrained)."""
        return self.checks.structured(params)

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its KV cache on every worker."""
        self._results.pop(request_id, None)
        self._queues.pop(request_id, None)
        requests = self._requests
        if not self._dead and not self._closed and requests is not None:
            requests.put(AbortRequest(request_id))

    def results(self, request_id: str, poll_seconds: float = 0.2) -> Iterator[StepOutput]:
        """Yields the request's tokens as they arrive; raises EngineDeadError if a worker dies."""
        q = self._queues[request_id]
        while True:
            try:
                item = q.get(timeout=poll_seconds)
            except queue.Empty:
                self._check_alive()
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                self._queues.pop(request_id, None)
                return

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._requests.put(StopScheduler())
        except Exception:  # queue already broken by a dead worker: killed below
            pass
        for p in self._procs:
            p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                log.warning("%s did not exit within 10 s of the shutdown: killed", p.name)
                p.kill()                  # (a worker ignores SIGTERM: engine/worker.py _owned_by_parent)
                p.join(timeout=5)
        for q in (self._requests, self._outputs):   # release the queues' semaphores now, not at exit
            q.close()
            q.cancel_join_thread()
        self._requests = self._outputs = None
        router = getattr(self, "_router", None)
        if router is not None and router is not threading.current_thread():
            router.join(timeout=5)   # it holds the output queue while it waits (0.5 s at most)
        for p in self._procs:   # the Process objects still hold the queues in their arguments
            p._args = ()
        gc.collect()
        atexit.unregister(self.shutdown)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def dead_reason(self) -> str | None:
        """None while the engine serves; else why it stopped (a worker died, or it was shut down)."""
        return self._dead or ("the engine was shut down" if self._closed else None)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the engine admits, summed over workers."""
        return self.worker_facts[0].kv_capacity_total

    @property
    def kernel(self) -> str:
        return self.worker_facts[0].kernel if self.worker_facts else "?"

    # ---- internals --------------------------------------------------------------------------
    def _start_workers(self) -> None:
        """This host's workers: ranks 0 .. (the other hosts start theirs after the rendezvous)."""
        ctx = mp.get_context("spawn")
        self._requests, self._outputs = ctx.Queue(), ctx.Queue()
        init = self.cluster.workers_init_method if self._head else f"tcp://127.0.0.1:{_free_port()}"
        # the control plane (engine/control.py): pipes when every worker is here, gloo across hosts
        local = self._head is None and self.engine.world_size > 1
        writers, readers = make_pipes(ctx, self.engine.world_size) if local else ([], [None] * self._local_workers)
        self._procs = [ctx.Process(target=spawned_worker_main, daemon=True, name=f"burstserve-worker{r}",
                                   args=(r, self.engine, init, self._requests if r == 0 else None, self._outputs,
                                         (writers if r == 0 else readers[r]) if local else None))
                       for r in range(self._local_workers)]
        try:
            for p in self._procs:
                p.start()
        finally:
            close_parent_ends(writers, readers)
        facts = {}
        while len(facts) < len(self._procs):
            msg = self._next_message()
            if isinstance(msg, WorkerReady):
                facts[msg.rank] = msg.facts
            elif isinstance(msg, WorkerFailed):
                self._fail(f"worker {msg.rank} failed to start: {msg.error}\n{msg.trace}")
                raise EngineDeadError(self._dead)
        self.worker_facts = [facts[r] for r in range(len(self._procs))]
        self.checks = RequestChecks(self.engine, self.model_config, self.tokenizer, self.max_model_len,
                                    self.worker_facts[0])
        log.info("engine ready: %d worker(s) on %s, attention kernel %s", len(self._procs),
                 ",".join(self.engine.devices), self.kernel)
        self._router = threading.Thread(target=self._route_outputs, daemon=True, name="burstserve-outputs")
        self._router.start()

    def _next_message(self):
        while True:
            outputs = self._outputs
            if outputs is None:
                raise EngineDeadError("the engine was shut down")
            try:
                return outputs.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    self._fail(f"{dead[0].name} exited with code {dead[0].exitcode}")
                    raise EngineDeadError(self._dead)
                gone = self._dead_host()
                if gone:
                    self._fail(gone)
                    raise EngineDeadError(self._dead)

    def _route_outputs(self) -> None:
        while not self._closed:
            try:
                msg = self._next_message()
            except EngineDeadError:
                return
            except (EOFError, OSError, AttributeError):   # AttributeError: shut down while waiting
                if not self._closed:
                    self._fail("the engine's output queue closed")
                return
            if isinstance(msg, Tokens):
                for item in msg.items:
                    self._route(item)
            elif isinstance(msg, EngineStats):
                self.stats = msg.figures
            elif isinstance(msg, WorkerFailed):
                self._fail(f"{msg.describe()}\n{msg.trace}")
                return

    def _dead_host(self) -> str | None:
        """With other hosts: why one of them is gone (it reported a failure, or its heartbeat stopped)."""
        if self._head is None:
            return None
        try:
            return self._head.dead_host()
        except Exception as e:    # the head's own store failing: nothing can be coordinated any more
            return f"the rendezvous at {self.cluster.where()} failed: {e}"

    def _route(self, item: StepOutput) -> None:
        sink = self._results.get(item.request_id)
        if item.finish_reason is not None:
            self._results.pop(item.request_id, None)
        if sink is not None:
            sink(item)

    def _fail(self, reason: str) -> None:
        if self._closed:
            return
        self._dead = reason
        log.error("engine failed: %s", reason)
        for sink in list(self._results.values()):
            sink(EngineDeadError(reason))
        self._results.clear()
        for p in self._procs:
            if p.is_alive():
                p.kill()

    def _check_alive(self) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    def _collect(self, request_id: str, prompt: Prompt | None, prompt_ids: list[int]) -> RequestOutput:
        arrival = self._arrivals.pop(request_id, time.time())
        return request_output(request_id, prompt if isinstance(prompt, str) else None, prompt_ids,
                              self.results(request_id), arrival, self.tokenizer.decode)


def _engine_config(model: str, values: dict, nnodes: int) -> EngineConfig:
    """The engine's configuration from the checked options: a packaged model's name read as its GGUF file, a
    GGUF file converted once to transformers' format (engine/model/gguf.py, into a cache folder), what the devices
    cannot run refused (DeviceSpecError), the KV host tier sized."""
    model = packaged_model(model) or model
    engine = engine_config(model, _devices(values), values)
    if not engine.is_preset and gguf_file(model) is not None:
        if nnodes > 1:
            raise ModelLoadError(f"{model} is a GGUF file; an engine over several hosts needs a checkpoint in "
                                 "transformers' format on every host (the folder this host converts it to, "
                                 "engine/model/gguf.py, copied to the same path there)")
        engine = dataclasses.replace(engine, model=converted_checkpoint(model, engine.dtype))
    refusal = (quantization_refusal(engine.quantization, engine.devices, engine.dtype)
               or kv_cache_refusal(engine.kv_cache_dtype, engine.devices))
    if refusal:
        raise DeviceSpecError(refusal)
    engine = dataclasses.replace(engine, kv_offload_gb=offload_gib(engine.kv_offload_gb, engine.devices,
                                                                   engine.world_size))
    if engine.kv_offload_gb and values["kv_offload_gb"] is None:
        log.info("KV host tier: %.1f GiB per worker (by default a quarter of what this host can pin; "
                 "--kv-offload-gb sets it, 0 turns it off)", engine.kv_offload_gb)
    return engine


def _devices(values: dict) -> list[str]:
    """This host's worker devices from the checked options (DeviceSpecError: the machine cannot satisfy
    them, or the attention backend cannot run on them); as many as the strategy runs on."""
    devices = resolve_devices(values["devices"], values["context_parallel_size"])
    refusal = backend_refusal(values["attention_backend"], devices)
    if refusal:
        raise DeviceSpecError(refusal)
    return devices[:STRATEGIES[values["sp_strategy"]].max_workers]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


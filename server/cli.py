"""The `burstserve` command: `burstserve serve [--model PATH|PRESET] [--devices ...] ...`, `burstserve worker ...`
(another host joining a `serve --nnodes N`), `burstserve bench ...`."""
import argparse
import logging
import os
import socket
import sys

import uvicorn

from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, preset_names
from engine.parallel import SP_STRATEGIES
from kernels.attention import ATTENTION_BACKENDS

log = logging.getLogger("burstserve")


def _add_engine_args(p) -> None:
    """What every host of an engine names: the model and its settings (the same on every host: JOIN_FIELDS
    of engine/cluster.py) and its own devices; `serve` and `worker` alike."""
    p.add_argument("--model", default="tiny", help=f"a local model directory or a preset ({', '.join(preset_names())})")
    p.add_argument("--devices", default=None,
                   help="devices as torch names them: cpu, cuda (every visible GPU), cuda:1 (GPU 1), cuda:0,2 "
                        "(default: every visible GPU, else cpu)")
    p.add_argument("-cp", "--context-parallel-size", type=int, default=None, metavar="N",
                   help="worker processes that split each prompt (default: every named GPU; on CPU, 1); "
                        "on CUDA the first N named GPUs, on CPU N processes on cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on GPUs, float32 on CPU")
    p.add_argument("--quantization", "-q", default="none", choices=["none", "fp8"],
                   help="fp8: the linear layers' weights quantized to FP8 at load (per-channel scales) and their "
                        "inputs per token, GEMMs on FP8 tensor cores (compute capability 8.9+); attention, norms, "
                        "embeddings and the LM head stay bfloat16")
    p.add_argument("--sp-strategy", default="burst", choices=SP_STRATEGIES,
                   help="how prefill attention spans the workers (decoding is the same for all); "
                        "auto: ulysses for short prompts, burst for long ones")
    p.add_argument("--seed", type=int, default=0, help="seed of the preset's random weights")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _add_cluster_args(p, head: bool) -> None:
    """One engine over several hosts (engine/cluster.py)."""
    p.add_argument("--nnodes", type=int, default=1, help="hosts in the engine (default 1: this one)")
    if head:
        p.add_argument("--node-rank", type=int, default=0, help="0: `serve` runs the head (other hosts: `worker`)")
    else:
        p.add_argument("--node-rank", type=int, required=True,
                       help="this host's place, 1 .. nnodes-1 (the head, `burstserve serve`, is 0); its workers' "
                            "ranks follow the hosts before it")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="the head's address, where it keeps the rendezvous (and its worker 0 the workers' group)")
    p.add_argument("--master-port", type=int, default=29500,
                   help="the rendezvous port on the head; the workers' process group takes the next one")
    p.add_argument("--join-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long the head waits for every host to join (and a host for the head's answer)")


def serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_engine_args(p)
    _add_cluster_args(p, head=True)
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together at most")
    p.add_argument("--max-waiting", type=int, default=256, help="requests waiting for a first token before 429")
    p.add_argument("--max-request-body-bytes", type=int, default=128 << 20)
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV capacity per worker in tokens (default: sized from --gpu-memory-utilization; 1M on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of each GPU's memory for weights, activations and the paged KV cache (0-1]")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV page (default: 128 on GPUs, 16 on CPU)")
    p.add_argument("--enforce-eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch the next decode step before reading back the tokens of the one running, its "
                        "input tokens taken on the GPU (default: on; off for a batch with a response_format); "
                        "--no-async-scheduling: every step read back before the next")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep finished requests' KV in the cache (evicted least recently used first) and prefill "
                        "only what a new prompt adds to the longest cached prefix (default: on; "
                        "--no-enable-prefix-caching: every prompt prefilled whole)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill a prompt longer than --max-num-batched-tokens in chunks, and a shorter one too "
                        "when in one call it would hold the running requests past --itl-target-ms; the running "
                        "requests decode between chunks and short new prompts go before the next chunk (default: "
                        "on; --no-enable-chunked-prefill: every prompt in one prefill, the others wait for it)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help=f"the largest chunk of chunked prefill (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    p.add_argument("--itl-target-ms", type=float, default=50.0, metavar="MS",
                   help="with chunked prefill: while other requests decode, each chunk is sized so that it "
                        "and one decode step take about MS milliseconds, from a cost model fitted to the engine's own "
                        "prefill times; alone, chunks are N tokens. 0: chunks of N tokens always")
    p.add_argument("--mixed-batch", action=argparse.BooleanOptionalAction, default=None,
                   help="with chunked prefill: a chunk after a prompt's first and the running requests' "
                        "decode step run as one forward pass (the weights read once for both). Default: on where "
                        "the workers replay that pass as CUDA graphs (CUDA with flash-attn-4, chunks up to 1024 "
                        "tokens graphed), else a chunk, then a decode step; --no-mixed-batch: never")
    p.add_argument("--extend-ring-min-tokens", type=int, default=4096, metavar="N",
                   help="on several workers, a prompt chunk or the part of a prompt after its cached prefix of at "
                        "least N tokens is sharded over the workers (K/V ring, queries passed to the cache); "
                        "fewer run whole on every worker, one worker keeping their K/V (one collective a layer). "
                        "0: always sharded")
    p.add_argument("--auto-ulysses-max-tokens", type=int, default=16384,
                   help="--sp-strategy auto: the longest prompt that uses ulysses")
    p.add_argument("--zero-sliced-max-tokens", type=int, default=None, metavar="N",
                   help="--sp-strategy burst-zero: prompts of at most N tokens run on the weight slices as they "
                        "lie (tensor parallel, no layer gathered; K/V kept in burst's layout). Default: measured "
                        "at start on GPUs (a layer's gather against a row's GEMMs and all-reduces), none on "
                        "CPU; at most a worker's share of --max-model-len. 0: never. Other strategies: unused")
    p.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="the local attention kernel: auto (flash-attn-4 on SM90+ when installed, then cuDNN, "
                        "PyTorch's FA2; on CPU PyTorch's CPU flash kernel, then the reference) or one by name")
    p.add_argument("--no-overlap", action="store_true", help="exchange K/V blocks without overlapping compute")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between the log lines on throughput, requests and KV usage while busy (0: never)")


def worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="join this host's devices to the engine of a `burstserve serve --nnodes N` "
                                      "on another host (the same --model, --dtype, --sp-strategy, ...)")
    _add_engine_args(p)
    _add_cluster_args(p, head=False)


def _setup_logging(args) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("BURSTSERVE_LOG_LEVEL", args.log_level.upper())   # the worker processes' level too


def worker(args) -> None:
    """A joining host (engine/cluster.py): its workers run ranks after the hosts before it, until the
    engine shuts down (exit 0) or fails (exit 1); refused or unreachable: exit 2, saying why."""
    from engine import BurstServeError
    from engine.cluster import ClusterConfig, join, join_settings, run_joined_workers
    from engine.config import EngineConfig, resolve_model
    from engine.devices import resolve_devices
    from engine.weights import weight_files
    _setup_logging(args)
    cluster = ClusterConfig(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.join_timeout)
    problem = cluster.problem() or ("node rank 0 is the head: run `burstserve serve --nnodes ...` there, and "
                                    "`burstserve worker --node-rank 1 ..` on the others" if args.node_rank == 0 else None)
    if problem:
        log.error("%s", problem)
        sys.exit(2)
    try:
        devices = resolve_devices(args.devices, args.context_parallel_size)
        dtype = args.dtype or ("bfloat16" if devices[0].startswith("cuda") else "float32")
        local = EngineConfig(model=args.model, devices=devices, dtype=dtype, sp_strategy=args.sp_strategy,
                             quantization=args.quantization, seed=args.seed)
        resolve_model(local)                 # the model is here, before joining (its files too)
        if not local.is_preset:
            weight_files(args.model)
        engine, first_rank, store = join(cluster, join_settings(local), devices)
    except BurstServeError as e:
        log.error("%s", e)
        sys.exit(2)
    log.info("node rank %d joined %s: ranks %d .. %d of %d on %s", args.node_rank, cluster.where(), first_rank,
             first_rank + len(devices) - 1, engine.world_size, ",".join(devices))
    sys.exit(run_joined_workers(cluster, engine, first_rank, len(devices), store))


def serve(args) -> None:
    from engine import LLM, BurstServeError
    from engine.worker import GIL_SWITCH_INTERVAL, freeze_heap
    from server.app import build_app
    _setup_logging(args)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)    # the router thread delivers tokens while a long body parses
    if args.node_rank != 0:
        log.error("burstserve serve runs the head, node rank 0; on the other hosts run `burstserve worker "
                  "--node-rank R ...` (R = 1 .. --nnodes - 1)")
        sys.exit(2)
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        sys.exit(2)
    try:
        llm = LLM(model=args.model, devices=args.devices, context_parallel_size=args.context_parallel_size,
                  dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, sp_strategy=args.sp_strategy, overlap=not args.no_overlap,
                  auto_ulysses_max_tokens=args.auto_ulysses_max_tokens,
                  zero_sliced_max_tokens=args.zero_sliced_max_tokens,
                  seed=args.seed, kv_cache_tokens=args.kv_cache_tokens,
                  gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
                  cuda_graphs=not args.enforce_eager, attention_backend=args.attention_backend,
                  async_scheduling=args.async_scheduling,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_chunked_prefill=args.enable_chunked_prefill,
                  enable_prefix_caching=args.enable_prefix_caching, itl_target_ms=args.itl_target_ms or None,
                  mixed_batch=args.mixed_batch, extend_ring_min_tokens=args.extend_ring_min_tokens,
                  nnodes=args.nnodes, master_addr=args.master_addr, master_port=args.master_port,
                  join_timeout=args.join_timeout,
                  quantization=args.quantization)
    except BurstServeError as e:
        log.error("%s", e)
        sys.exit(2)
    name = args.served_model_name or args.model
    log.info("model %s (served as %r), %d worker(s) on %s, dtype %s, attention kernel %s, max_model_len %d, "
             "KV capacity %d tokens", args.model, name, llm.engine.world_size, ",".join(llm.engine.devices),
             llm.engine.dtype, llm.kernel, llm.max_model_len, llm.kv_capacity_tokens)
    log.info("listening on http://%s:%d", args.host, args.port)
    app = build_app(llm, name, api_key=args.api_key, max_waiting=args.max_waiting,
                    max_body_bytes=args.max_request_body_bytes, log_requests=not args.disable_log_requests,
                    log_stats_interval=args.log_stats_interval)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS)
    freeze_heap()     # the collector never walks torch's and the app's objects again (engine/worker.py)
    try:
        DrainingServer(config, app.state.ctx.engine).run(sockets=[sock])
    finally:
        llm.shutdown()


def listening_socket(host: str, port: int) -> socket.socket:
    """The HTTP port, bound before the engine starts (as vLLM does): a port in use is refused at once,
    not after the model loads, and no process the engine starts (its workers' rendezvous and
    connections take ports from the same ephemeral range) can take it meanwhile. uvicorn listens on it."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
    except OSError:
        sock.close()
        raise
    return sock


SHUTDOWN_GRACE_SECONDS = 5   # after SIGTERM, connections still open after this are closed


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM/SIGINT first ends every in-flight request with a 503 (a stream
    gets an error event and [DONE]); uvicorn then closes idle connections and exits. Without it,
    uvicorn would wait for every open stream to finish."""

    def __init__(self, config: uvicorn.Config, engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        loop = self.engine.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.engine.shut_down)   # safe from a signal handler
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="burstserve", description="Long-context LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub)
    worker_parser(sub)
    from clients.bench import add_parser as bench_parser
    bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args)
    elif args.command == "worker":
        worker(args)
    elif args.command == "bench":
        from clients.bench import run as run_bench
        run_bench(args)


if __name__ == "__main__":
    main()

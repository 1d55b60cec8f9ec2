"""The `burstserve` command: `burstserve serve [--model PATH|PRESET] [--devices ...] ...`, `burstserve worker ...`
(another host joining a `serve --nnodes N`), `burstserve bench ...`."""
import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading

import uvicorn

from burstserve.engine.model.config import preset_names
from burstserve.engine.model.gguf import PACKAGED_MODELS
from burstserve.engine.options import OPTIONS, add_arguments, from_args
from burstserve.server.vllm_flags import DEFAULT_MODEL, add_vllm_flags, apply_vllm_flags

log = logging.getLogger("burstserve")


def _add_engine_args(p) -> None:
    """What every host of an engine names, `serve` and `worker` alike: the model and its settings (the same
    on every host: JOIN_FIELDS of engine/cluster.py), its own devices, and where the hosts meet
    (engine/cluster.py); each an engine option of engine/options.py but the model."""
    p.add_argument("--model", default=None, help=f"a local model directory, a GGUF file, a trained model a "
                   f"package carries ({', '.join(PACKAGED_MODELS)}) or a preset of random weights "
                   f"({', '.join(preset_names())}); default: {DEFAULT_MODEL}")
    add_arguments(p, (o for o in OPTIONS if o.on_worker))
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="default: %(default)s")


def serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_engine_args(p)
    p.add_argument("--node-rank", type=int, default=0, help="0: `serve` runs the head (other hosts: `worker`)")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface; "
                   "default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests waiting for a first token before 429 (default: %(default)s)")
    p.add_argument("--max-request-body-bytes", type=int, default=128 << 20,
                   help="a larger request body is refused with 413 (default: %(default)s)")
    add_arguments(p, (o for o in OPTIONS if not o.on_worker))
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between the log lines on throughput, requests and KV usage while busy (0: never)")
    add_vllm_flags(p, log_stats=True)
    p.set_defaults(command_parser=p)


def worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="join this host's devices to the engine of a `burstserve serve --nnodes N` "
                                      "on another host (the same --model, --dtype, --sp-strategy, ...)")
    _add_engine_args(p)
    p.add_argument("--node-rank", type=int, required=True,
                   help="this host's place, 1 .. nnodes-1 (the head, `burstserve serve`, is 0); its workers' "
                        "ranks follow the hosts before it")
    add_vllm_flags(p, log_stats=False)
    p.set_defaults(command_parser=p)


def _setup_logging(args) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("BURSTSERVE_LOG_LEVEL", args.log_level.upper())   # the worker processes' level too


def worker(args) -> None:
    """A joining host (engine/cluster.py): its workers run ranks after the hosts before it, until the
    engine shuts down (exit 0) or fails (exit 1); refused or unreachable: exit 2, saying why."""
    from burstserve.engine import BurstServeError
    from burstserve.engine.cluster import join, join_settings, run_joined_workers
    from burstserve.engine.model.config import resolve_model
    from burstserve.engine.core.devices import resolve_devices
    from burstserve.engine.options import check_options, cluster_config, engine_config
    from burstserve.engine.model.weights import weight_files
    _setup_logging(args)
    try:
        values = check_options(from_args(args))
    except BurstServeError as e:
        log.error("%s", e)
        sys.exit(2)
    cluster = cluster_config(values, args.node_rank)
    problem = cluster.problem() or ("node rank 0 is the head: run `burstserve serve --nnodes ...` there, and "
                                    "`burstserve worker --node-rank 1 ..` on the others" if args.node_rank == 0 else None)
    if problem:
        log.error("%s", problem)
        sys.exit(2)
    try:
        devices = resolve_devices(args.devices, args.context_parallel_size)
        local = engine_config(args.model, devices, values)
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
    from burstserve.engine import LLM, BurstServeError
    from burstserve.engine.worker import GIL_SWITCH_INTERVAL, exit_after_shutdown, freeze_heap
    from burstserve.server.app import build_app
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
        llm = LLM(model=args.model, **from_args(args))
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
    exit_after_shutdown([])      # no teardown: a GGUF conversion here loaded Triton's bindings, which report at exit


def listening_socket(host: str, port: int) -> socket.socket:
    """The HTTP port, bound before the engine starts (as vLLM does): a port in use is refused at once,
    not after the model loads, and no process the engine starts (its workers' rendezvous and
    connections take ports from the same ephemeral range) can take it meanwhile. uvicorn listens on it.
    Made with the protocol getaddrinfo names (TCP): asyncio sets TCP_NODELAY only on accepted sockets whose
    protocol is IPPROTO_TCP, and without it Nagle's algorithm holds a stream's first token behind the
    response headers until the client's delayed ACK, about 40 ms later."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


SHUTDOWN_GRACE_SECONDS = 5   # after SIGTERM, connections still open after this are closed


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM/SIGINT first ends every in-flight request with a 503 (a stream
    gets an error event and [DONE]); uvicorn then closes idle connections and exits. Without it,
    uvicorn would wait for every open stream to finish. A second signal while it shuts down is logged and
    changes nothing (the shutdown takes well under a second)."""

    def __init__(self, config: uvicorn.Config, engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:     # uvicorn would force the exit, skipping the app's shutdown (a traceback, no drain)
            log.info("%s again: already shutting down", signal.Signals(sig).name)
            return
        log.info("%s: shutting down (in-flight requests end with 503)", signal.Signals(sig).name)
        loop = self.engine.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.engine.shut_down)   # safe from a signal handler
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, less its last step: after a graceful shutdown uvicorn raises the signal again, which
        turns Ctrl-C into a KeyboardInterrupt traceback and exit status 130 (and SIGTERM into death by the
        signal). A shutdown that went as asked is a success: `serve` returns and the process exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("burstserve")
    except PackageNotFoundError:             # run from a checkout that was not installed
        return "(not installed)"


COMMANDS_GROUP = "burstserve.commands"    # entry points: subcommands other packages add (pyproject.toml: bench)


def added_commands() -> dict:
    """name -> the module of each subcommand the installed distribution adds (clients/bench.py's `bench`): it has
    add_parser(subparsers) and run(args). A checkout that was not installed has none (`python -m burstserve.clients.bench`
    runs the benchmark there)."""
    from importlib.metadata import entry_points
    return {point.name: point.load() for point in entry_points(group=COMMANDS_GROUP)}


def build_parser(commands: dict | None = None) -> argparse.ArgumentParser:
    """The `burstserve` command line: serve, worker and the added commands (bench)."""
    parser = argparse.ArgumentParser(prog="burstserve", description="Long-context LLM inference server")
    parser.add_argument("--version", action="version", version=f"burstserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub)
    worker_parser(sub)
    for module in (added_commands() if commands is None else commands).values():
        module.add_parser(sub)
    return parser


def parse_command_line(argv: list[str], commands: dict | None = None) -> argparse.Namespace:
    """The parsed command line, vLLM's flags turned into this engine's (server/vllm_flags.py)."""
    args = build_parser(commands).parse_args(argv)
    if args.command in ("serve", "worker"):
        apply_vllm_flags(args, args.command_parser, argv)
    return args


def main(argv: list[str] | None = None) -> None:
    commands = added_commands()
    args = parse_command_line(sys.argv[1:] if argv is None else argv, commands)
    if args.command == "serve":
        serve(args)
    elif args.command == "worker":
        worker(args)
    else:
        commands[args.command].run(args)


if __name__ == "__main__":
    main()

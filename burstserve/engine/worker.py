"""The worker process: one per device. Worker 0 also runs the scheduler and drives the others.

Started by `LLM` with torch.multiprocessing (spawn), or by `torchrun` (RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT in the environment; see `main`). There is exactly one way for worker 0
to drive the rest: its scheduler's `call(message)` (engine/scheduler/dispatch.py) runs the call locally and sends
the same calls, one Turn message a scheduler turn, over the control plane (engine/control.py: pipes when
every worker is on worker 0's host, a gloo group otherwise); every other worker loops receiving Turns and
running their calls in order.
"""
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from burstserve.engine.cache.kv_manager import KVManager
from burstserve.engine.control import GlooControl, PipeControl
from burstserve.engine.core.calls import Shutdown, Turn
from burstserve.engine.core.messages import AddRequest, StopScheduler, Tokens, WorkerFailed, WorkerReady
from burstserve.engine.model.config import EngineConfig, default_dtype, resolve_model
from burstserve.engine.runner.model_runner import ModelRunner, worker_facts
from burstserve.engine.scheduler.dispatch import Dispatch
from burstserve.engine.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)
# A thread holding the GIL hands it over within this many seconds when another asks: Python's default (5 ms)
# holds a finished request's token in the output queue's feeder thread while the scheduler fills the prefix
# cache, a delay on every first token (docs/benchmarks.md, HTTP overhead). Set in the workers and the server.
GIL_SWITCH_INTERVAL = 0.001
# Operator's profiling switch: a file path; worker 0's scheduler loop runs under cProfile and its stats are
# written there at shutdown (profiled; scripts/gpu_scheduler_profile.py reads them)
PROFILE_ENV = "BURSTSERVE_PROFILE_SCHEDULER"
PARENT_POLL_SECONDS = 0.5      # how often a spawned worker checks that the process that started it lives


def spawned_worker_main(*args) -> None:
    """worker_main in a process that `LLM` (engine/llm.py) or a joining host (engine/cluster.py) started."""
    _owned_by_parent()
    worker_main(*args)
    exit_after_shutdown([a for a in args if hasattr(a, "join_thread")])


def exit_after_shutdown(queues: list) -> None:
    """A worker, or the server, that shut down cleanly ends here: its queues' last messages flushed and the logs
    written, then exit 0 without the interpreter's teardown, whose only visible work would be the Triton bindings'
    report of the objects still alive at exit (nanobind's "leaked ..." lines, noise in the server's log at a stop)."""
    for q in queues:
        q.close()
        q.join_thread()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _owned_by_parent() -> None:
    """The process that started this worker shuts it down (a Shutdown call; SIGKILL after 10 s). SIGTERM and
    SIGINT sent to the whole process group (timeout, systemd, Ctrl-C) are that process's to handle: a worker
    dying of them first reads as an engine failure and leaks its queues' semaphores, so it ignores them. It
    never outlives that process: a thread ends it within PARENT_POLL_SECONDS of the parent's death, however
    the parent died."""
    parent = os.getppid()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="burstserve-parent-watch").start()


def worker_main(rank: int, engine: EngineConfig, init_method: str | None, requests, outputs, pipes=None) -> None:
    """Entry point of worker `rank`. init_method None: read the rendezvous from the environment. pipes
    (every worker on one host): worker 0's write ends (a list), another worker's read end; None: gloo."""
    # the workers' log level: `serve --log-level` sets BURSTSERVE_LOG_LEVEL (server/cli.py) so spawned workers
    # log as the server does; set by hand for an offline LLM (default WARNING)
    logging.basicConfig(level=os.environ.get("BURSTSERVE_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s worker{rank} %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    runner = None
    try:
        device = _setup_device(rank, engine)
        cfg, max_model_len = resolve_model(engine)
        data_group, gloo = _init_groups(rank, engine, device, init_method, gloo_control=pipes is None)
        control = None if engine.world_size == 1 else (
            GlooControl(gloo) if pipes is None else
            PipeControl(writers=pipes) if rank == 0 else PipeControl(reader=pipes))
        runner = ModelRunner(engine, cfg, rank, device, data_group, max_model_len)
        freeze_heap()
        outputs.put(WorkerReady(rank, worker_facts(runner)))
        call = _make_call(runner, control, engine.world_size)
        if rank == 0:
            scheduler = Scheduler(call, requests, outputs, engine, cfg, worker_facts(runner), max_model_len,
                                  cfg.eos_token_ids)
            profiled(scheduler.run, os.environ.get(PROFILE_ENV))
            call(Shutdown())
        else:
            _follow(runner, control)
    except BaseException as e:  # report every failure to the engine before dying: never hang it
        outputs.put(WorkerFailed(rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if runner is not None:     # before the group: graphs that captured NCCL calls hold its communicator
            try:
                runner.release_graphs()
            except Exception:          # a broken device: the group is still destroyed
                log.exception("worker %d: releasing the CUDA graphs failed", rank)
            try:
                runner.cache.release_host_tier()
            except Exception:
                log.exception("worker %d: unpinning the KV host tier failed", rank)
        if dist.is_initialized():
            dist.destroy_process_group()


def profiled(run, path: str | None) -> None:
    """run(); with a path (BURSTSERVE_PROFILE_SCHEDULER), under cProfile, its stats written there when run
    returns (the engine's shutdown): where worker 0's host time goes between GPU calls."""
    if not path:
        return run()
    import cProfile
    profile = cProfile.Profile()
    try:
        profile.runcall(run)
    finally:
        profile.dump_stats(path)


def freeze_heap() -> None:
    """After start-up: every object alive (torch, the model, its kernels: ~400K) moves to the collector's
    permanent generation, never walked again. A full collection walks them all: a stall of a hundred
    milliseconds or more inside a prefill or between two tokens (vLLM and SGLang freeze theirs too)."""
    gc.collect()
    gc.freeze()


def _setup_device(rank: int, engine: EngineConfig) -> torch.device:
    device = torch.device(engine.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(host_threads(engine.world_size))
    return device


def host_threads(world_size: int) -> int:
    """A worker's intra-op threads: the workers share the host's cores (without a limit each would start
    one thread per core, and an op over a prompt's rows waits for its slowest thread)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _init_groups(rank: int, engine: EngineConfig, device: torch.device, init_method: str | None,
                 gloo_control: bool = True):
    """Data plane: NCCL on GPUs, gloo on CPU. Control plane (gloo_control): a separate gloo group."""
    if engine.world_size == 1:
        return None, None
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                            world_size=engine.world_size, **kwargs)
    return None, dist.new_group(backend="gloo") if gloo_control else None


def runner_alone(runner: ModelRunner) -> KVManager:
    """A KV manager over this runner alone, for tools and tests that drive ModelRunners without a scheduler (on
    several workers each one makes its own and places alike): kv.call(message) places work and runs it here."""
    call = Dispatch(lambda message: runner.execute(kv.place(message)), None)
    kv = KVManager.of_workers(runner.engine, worker_facts(runner), call, prefix_caching=False)
    return kv


def _make_call(runner: ModelRunner, control, world_size: int) -> Dispatch:
    """Worker 0's `call(message)`: run here, sent to every other worker in that turn's Turn; the host tier's
    progress read after each."""
    return Dispatch(runner.execute, control.send if world_size > 1 else None, runner.cache.host_progress)


def _follow(runner: ModelRunner, control) -> None:
    """Another worker: runs worker 0's calls in order, a Turn at a time, until Shutdown."""
    while True:
        turn: Turn = control.receive()
        for message in turn.changes:
            runner.execute(message)
        if isinstance(turn.work, Shutdown):
            return
        if turn.work is not None:
            runner.execute(turn.work)


def main(argv: list[str] | None = None) -> None:
    """Run under torchrun: `torchrun --nproc-per-node N -m burstserve.engine.worker --model M --prompts P.json`.

    Every process is one worker (device cuda:LOCAL_RANK, or cpu); rank 0 runs the scheduler in a
    thread, feeds it the prompts (a JSON list of token-id lists), prints one JSON line per result
    and shuts the workers down. The same worker code as under `LLM`, for multi-host runs."""
    import argparse
    import json
    import queue
    import threading

    from burstserve.engine.model.config import EngineConfig
    from burstserve.engine.core.sampling import SamplingParams
    from burstserve.engine.core.outputs import Request

    ap = argparse.ArgumentParser(prog="python -m burstserve.engine.worker")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if args.device == "cuda" else "cpu"
    engine = EngineConfig(model=args.model, devices=[device] * world, dtype=args.dtype or default_dtype([device]))
    requests, outputs = queue.Queue(), queue.Queue()
    if rank != 0:
        worker_main(rank, engine, None, None, outputs)
        return
    with open(args.prompts) as f:
        prompts = json.load(f)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        requests.put(AddRequest(Request(str(i), ids, params, time.time())))
    runner = threading.Thread(target=worker_main, args=(0, engine, None, requests, outputs))
    runner.start()
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    done = 0
    while done < len(prompts):
        msg = outputs.get()
        if isinstance(msg, WorkerFailed):
            raise SystemExit(msg.describe())
        for item in msg.items if isinstance(msg, Tokens) else []:
            tokens[item.request_id].append(item.token_id)
            done += item.finish_reason is not None
    for i in range(len(prompts)):
        print(json.dumps({"prompt": i, "token_ids": tokens[str(i)]}), flush=True)
    requests.put(StopScheduler())
    runner.join()


if __name__ == "__main__":
    main()

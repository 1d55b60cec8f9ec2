"""The worker process: one per device. Worker 0 also runs the scheduler and drives the others.

Started by `LLM` with torch.multiprocessing (spawn), or by `torchrun` (RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT in the environment; see `main`). There is exactly one way for worker 0
to drive the rest: `call(name, *args)` broadcasts (name, args) on a gloo control group and runs
the same method locally; every other worker loops receiving and running those calls.
"""
import logging
import os
import traceback

import torch
import torch.distributed as dist

from engine.config import EngineConfig, resolve_model
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler

log = logging.getLogger(__name__)


def worker_main(rank: int, engine: EngineConfig, init_method: str | None, requests, outputs) -> None:
    """Entry point of worker `rank`. init_method None: read the rendezvous from the environment."""
    logging.basicConfig(level=os.environ.get("BURSTSERVE_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s worker{rank} %(levelname)s %(name)s: %(message)s")
    try:
        device = _setup_device(rank, engine)
        cfg, max_model_len = resolve_model(engine)
        data_group, control = _init_groups(rank, engine, device, init_method)
        runner = ModelRunner(engine, cfg, rank, device, data_group)
        outputs.put(("ready", rank, runner.info()))
        call = _make_call(runner, control, engine.world_size)
        if rank == 0:
            Scheduler(call, requests, outputs, engine.world_size, engine.max_num_seqs, max_model_len,
                      cfg.eos_token_ids, runner.kv_capacity_tokens, runner.kv_tokens_per_worker).run()
            call("shutdown")
        else:
            _follow(runner, control)
    except BaseException as e:  # report every failure to the engine before dying: never hang it
        outputs.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _setup_device(rank: int, engine: EngineConfig) -> torch.device:
    device = torch.device(engine.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // engine.world_size))
    return device


def _init_groups(rank: int, engine: EngineConfig, device: torch.device, init_method: str | None):
    """Data plane: NCCL on GPUs, gloo on CPU. Control plane: a separate gloo group."""
    if engine.world_size == 1:
        return None, None
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                            world_size=engine.world_size, **kwargs)
    control = dist.new_group(backend="gloo")
    return None, control


def _make_call(runner: ModelRunner, control, world_size: int):
    def call(name: str, *args):
        if world_size > 1:
            dist.broadcast_object_list([name, args], src=0, group=control)
        if name == "shutdown":
            return None
        return getattr(runner, name)(*args)
    return call


def _follow(runner: ModelRunner, control) -> None:
    while True:
        message = [None, None]
        dist.broadcast_object_list(message, src=0, group=control)
        name, args = message
        if name == "shutdown":
            return
        getattr(runner, name)(*args)

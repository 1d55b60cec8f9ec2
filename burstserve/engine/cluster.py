"""One engine over several hosts: the head (`burstserve serve --nnodes N --node-rank 0 ...`) runs the HTTP
server, the scheduler and its own workers; every other host (`burstserve worker --nnodes N --node-rank R
...`) joins with its workers. Each host names its own devices and worker count (`--devices`, `-cp`).

The rendezvous is torch.distributed's TCPStore, kept by the head at --master-addr:--master-port:
- a joining host offers its settings (model, dtype, strategy, quantization, KV cache dtype, seed:
  `JOIN_FIELDS`, which must be the head's) and its devices; the head refuses an offer that differs,
  naming the field, and waits on (until --join-timeout) for a host that matches;
- once every node rank has joined, the head publishes the plan: the engine over every host's workers,
  ranks host-major (the head's workers first, then node rank 1's, ...), so each host's workers are
  adjacent and the ring (rank r sends to r + 1) crosses hosts only at their boundaries, N crossings a
  step (the BurstAttention paper's topology-aware ring); the workers then join one torch.distributed
  process group at --master-addr:--master-port + 1 (NCCL between GPUs, gloo on CPUs), as on one host;
- while serving, each joined host adds to a counter every HEARTBEAT_SECONDS and reports a worker's
  failure under its node rank; the head's watchdog fails the engine (503, every in-flight request
  ended with an error) when a host reports one or its counter stands still for DEAD_AFTER_SECONDS, and
  a joined host whose head is gone stops its workers.
A host that never joins makes the head fail at start, naming the missing node ranks.
"""
import dataclasses
import json
import logging
import queue
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from burstserve.engine.core.errors import ClusterError
from burstserve.engine.core.messages import WorkerFailed, WorkerReady
from burstserve.engine.model.config import EngineConfig

log = logging.getLogger(__name__)

JOIN_FIELDS = ("model", "dtype", "sp_strategy", "quantization", "kv_cache_dtype", "seed")
HEARTBEAT_SECONDS = 0.5
DEAD_AFTER_SECONDS = 5.0


@dataclass(frozen=True)
class ClusterConfig:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    join_timeout: float = 300.0      # seconds the head waits for every host (and a host for the head's answer)

    def problem(self) -> str | None:
        """Why these settings cannot work, or None."""
        if self.nnodes < 1:
            return f"--nnodes must be at least 1, not {self.nnodes}"
        if not 0 <= self.node_rank < self.nnodes:
            return f"--node-rank must be in 0 .. {self.nnodes - 1} (--nnodes {self.nnodes}), not {self.node_rank}"
        if not 0 < self.master_port < 65535:
            return f"--master-port must be in 1 .. 65534 (the port after it is the workers'), not {self.master_port}"
        if not self.join_timeout > 0:
            return f"--join-timeout must be positive, not {self.join_timeout}"
        return None

    @property
    def workers_init_method(self) -> str:
        """Where the workers of every host meet for their process group (worker 0, on the head, keeps it)."""
        return f"tcp://{self.master_addr}:{self.master_port + 1}"

    def where(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


def join_settings(engine: EngineConfig) -> dict:
    return {f: getattr(engine, f) for f in JOIN_FIELDS}


def _store(cluster: ClusterConfig, is_master: bool) -> dist.TCPStore:
    try:
        return dist.TCPStore(cluster.master_addr, cluster.master_port, is_master=is_master, wait_for_workers=False,
                             timeout=timedelta(seconds=cluster.join_timeout))
    except Exception as e:   # RuntimeError / DistNetworkError: port taken, head unreachable
        role = "keep the rendezvous at" if is_master else "reach the head at"
        raise ClusterError(f"could not {role} {cluster.where()}: {e}") from e


class Head:
    """The head's side: the rendezvous, then the watch over the joined hosts."""

    def __init__(self, cluster: ClusterConfig):
        self.cluster = cluster
        self.store = _store(cluster, is_master=True)
        self._beats: dict[int, tuple[int, float]] = {}     # node rank -> (last counter, when it last moved)

    def gather(self, engine: EngineConfig) -> EngineConfig:
        """Waits for every other node rank to join with the head's settings -> the engine over all hosts'
        workers, ranks host-major (then `publish` it, or `abort`); raises ClusterError naming the node
        ranks missing at the timeout."""
        others = range(1, self.cluster.nnodes)
        joined: dict[int, list[str]] = {}
        refused: dict[int, str] = {}
        deadline = time.monotonic() + self.cluster.join_timeout
        log.info("waiting for node ranks %s to join at %s", list(others), self.cluster.where())
        while len(joined) < len(others):
            for k in others:
                if k not in joined and self.store.check([f"join/{k}"]):
                    offer = json.loads(self.store.get(f"join/{k}"))
                    self.store.delete_key(f"join/{k}")
                    reason = _mismatch(join_settings(engine), offer["settings"])
                    if reason:
                        refused[k] = reason
                        self.store.set(f"refused/{k}/{offer['attempt']}", reason)
                        log.warning("node rank %d refused: %s", k, reason)
                    else:
                        joined[k] = offer["devices"]
                        log.info("node rank %d joined with %d worker(s) on %s", k, len(offer["devices"]),
                                 ",".join(offer["devices"]))
            if len(joined) < len(others) and time.monotonic() > deadline:
                missing = [k for k in others if k not in joined]
                why = "".join(f"; node rank {k} was refused: {refused[k]}" for k in missing if k in refused)
                raise ClusterError(f"node rank(s) {', '.join(map(str, missing))} did not join at {self.cluster.where()} "
                                   f"within {self.cluster.join_timeout:g} s (--join-timeout){why}")
            time.sleep(0.05)
        devices, self._offsets = list(engine.devices), {0: 0}
        for k in others:
            self._offsets[k] = len(devices)
            devices += joined[k]
        return dataclasses.replace(engine, devices=devices)

    def publish(self, whole: EngineConfig) -> None:
        """Tells every joined host the engine to start its workers in; their heartbeats are watched from now."""
        self.store.set("plan", json.dumps({"engine": dataclasses.asdict(whole), "offsets": self._offsets}))
        now = time.monotonic()
        self._beats = {k: (0, now) for k in range(1, self.cluster.nnodes)}

    def abort(self, reason: str) -> None:
        """Tells every joined host that the engine will not start, and why."""
        self.store.set("abort", reason)

    def dead_host(self) -> str | None:
        """Why a joined host is gone (it reported a failure, or its heartbeat stood still for
        DEAD_AFTER_SECONDS), or None. Called about every HEARTBEAT_SECONDS by the engine's watchdog."""
        now = time.monotonic()
        for k, (count, moved) in self._beats.items():
            if self.store.check([f"error/{k}"]):
                return f"node rank {k} failed: {self.store.get(f'error/{k}').decode(errors='replace')}"
            beat = self.store.add(f"beat/{k}", 0)
            if beat != count:
                self._beats[k] = (beat, now)
            elif now - moved > DEAD_AFTER_SECONDS:
                return f"node rank {k} stopped answering (no heartbeat for {now - moved:.1f} s)"
        return None


def _mismatch(want: dict, offered: dict) -> str | None:
    for field in JOIN_FIELDS:
        if offered.get(field) != want[field]:
            return (f"its {field} is {offered.get(field)!r}, the head's is {want[field]!r} (every host takes the "
                    f"same --model, --dtype, --sp-strategy, --quantization, --kv-cache-dtype and --seed)")
    return None


def join(cluster: ClusterConfig, settings: dict, devices: list[str]) -> tuple[EngineConfig, int, dist.TCPStore]:
    """A joining host's side of the rendezvous -> (the engine over every host, this host's first rank, the
    store). Raises ClusterError when the head refuses it (naming why) or does not answer in time."""
    store = _store(cluster, is_master=False)
    attempt = uuid.uuid4().hex
    k = cluster.node_rank
    store.set(f"join/{k}", json.dumps({"settings": settings, "devices": devices, "attempt": attempt}))
    deadline = time.monotonic() + cluster.join_timeout
    while time.monotonic() < deadline:
        if store.check([f"refused/{k}/{attempt}"]):
            reason = store.get(f"refused/{k}/{attempt}").decode()
            raise ClusterError(f"the head at {cluster.where()} refused node rank {k}: {reason}")
        if store.check(["plan"]):
            plan = json.loads(store.get("plan"))
            return EngineConfig(**plan["engine"]), plan["offsets"][str(k)], store
        if store.check(["abort"]):
            raise ClusterError(f"the head at {cluster.where()} did not start the engine: {store.get('abort').decode()}")
        time.sleep(0.05)
    raise ClusterError(f"the head at {cluster.where()} did not answer node rank {k} within {cluster.join_timeout:g} s")


def run_joined_workers(cluster: ClusterConfig, engine: EngineConfig, first_rank: int, count: int,
                       store: dist.TCPStore) -> int:
    """Starts this host's workers (ranks first_rank ..) and watches them: heartbeats to the head, a worker's
    failure reported under this node rank. Returns the exit code: 0 when the engine shut down."""
    from burstserve.engine.worker import spawned_worker_main
    ctx = mp.get_context("spawn")
    outputs = ctx.Queue()
    procs = [ctx.Process(target=spawned_worker_main, daemon=True, name=f"burstserve-worker{first_rank + i}",
                         args=(first_rank + i, engine, cluster.workers_init_method, None, outputs))
             for i in range(count)]
    for p in procs:
        p.start()
    k = cluster.node_rank
    try:
        while True:
            failure = _local_failure(outputs, procs)
            if failure:
                store.set(f"error/{k}", failure)
                log.error("%s", failure)
                return 1
            if all(p.exitcode == 0 for p in procs):
                log.info("the engine shut down; node rank %d's workers exited", k)
                return 0
            try:
                store.add(f"beat/{k}", 1)
            except Exception as e:   # the head (and its store) is gone
                log.error("the head at %s is gone (%s): stopping node rank %d's workers", cluster.where(), e, k)
                return 1
            time.sleep(HEARTBEAT_SECONDS)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def _local_failure(outputs, procs) -> str | None:
    """A worker's reported error, or one that exited with a non-zero code, as a message; else None."""
    while True:
        try:
            msg = outputs.get_nowait()
        except queue.Empty:
            break
        if isinstance(msg, WorkerFailed):
            return msg.describe()
        if isinstance(msg, WorkerReady):
            log.info("worker %d ready", msg.rank)
    for p in procs:
        if p.exitcode not in (None, 0):
            return f"{p.name} exited with code {p.exitcode}"
    return None

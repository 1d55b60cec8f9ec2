"""The messages on the engine's two queues, one dataclass each (matched by type, never by a tag string).

requests, the front (LLM) to worker 0's scheduler:
  AddRequest        a prompt to run
  AbortRequest      a request to stop; its KV cache is freed on every worker
  StopScheduler     the scheduler's loop ends (the workers shut down after it)
outputs, the workers to the front:
  WorkerReady       a worker started; its facts (ModelRunner.info)
  WorkerFailed      a worker's exception, before it exits (never a silent hang)
  Tokens            sampled tokens: one, or a whole decode step's in one message (one pickle a step)
  EngineStats       the scheduler's gauges and counters (server/metrics.py reads them by name)
"""
from dataclasses import dataclass, field

from engine.outputs import Request, StepOutput


@dataclass(frozen=True)
class AddRequest:
    request: Request


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class StopScheduler:
    pass


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    info: dict


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    error: str           # "TypeName: message"
    trace: str = ""      # the formatted traceback

    def describe(self) -> str:
        return f"worker {self.rank} failed: {self.error}"


@dataclass(frozen=True)
class Tokens:
    items: list[StepOutput] = field(default_factory=list)


@dataclass(frozen=True)
class EngineStats:
    values: dict

"""Worker 0's Scheduler run in this process over one CPU ModelRunner, every call it makes to the workers
recorded, and every Turn message it would send the others: for tests of what the scheduler decides
(tests/engine/test_recompute.py, test_async_scheduling.py, test_step_plan.py)."""
import queue
import threading
import time

import torch

from burstserve.engine.core.calls import Shutdown
from burstserve.engine.core.messages import AddRequest, StopScheduler, Tokens, WorkerFailed
from burstserve.engine.core.outputs import Request
from burstserve.engine.model.config import EngineConfig, resolve_model
from burstserve.engine.runner.model_runner import ModelRunner, worker_facts
from burstserve.engine.scheduler.dispatch import Dispatch
from burstserve.engine.scheduler.scheduler import Scheduler


def serve_in_process(engine: EngineConfig, batches: list[list[tuple]], prepare=None, sent: list | None = None):
    """Each batch of (request id, prompt, SamplingParams) is submitted when the one before has finished ->
    (outputs by request id: lists of StepOutput, the scheduler's calls (engine/core/calls.py messages), the scheduler).
    prepare(scheduler, runner): called before it runs (to wrap its methods). sent: a list that receives the
    Turns the other workers would be sent (with the Shutdown that ends them)."""
    cfg, max_model_len = resolve_model(engine)
    runner = ModelRunner(engine, cfg, 0, torch.device("cpu"), None, max_model_len)
    calls = []

    def run_here(message):
        calls.append(message)
        return runner.execute(message)

    requests, outputs = queue.Queue(), queue.Queue()
    call = Dispatch(run_here, sent.append if sent is not None else None, runner.cache.host_progress)
    scheduler = Scheduler(call, requests, outputs, engine, cfg, worker_facts(runner), max_model_len, [])
    if prepare is not None:
        prepare(scheduler, runner)
    failure = []

    def run():
        try:
            scheduler.run()
        except Exception as e:          # seen by the test, not lost in the thread
            failure.append(repr(e))
            outputs.put(WorkerFailed(0, repr(e)))

    def submit(batch):
        for rid, prompt, params in batch:
            requests.put(AddRequest(Request(rid, prompt, params, time.time())))

    # the first batch is queued before the scheduler starts: its first turn sees all of it, however the
    # threads are scheduled (a workload meant to overlap its requests does, under any load)
    if batches:
        submit(batches[0])
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    got: dict[str, list] = {}
    for i, batch in enumerate(batches):
        if i:
            submit(batch)
        left = len(batch)
        while left:
            msg = outputs.get(timeout=120)
            assert not isinstance(msg, WorkerFailed), msg
            for out in (msg.items if isinstance(msg, Tokens) else []):
                got.setdefault(out.request_id, []).append(out)
                left -= out.finish_reason is not None
    requests.put(StopScheduler())
    thread.join(timeout=60)
    assert not failure, failure
    call(Shutdown())
    return got, calls, scheduler

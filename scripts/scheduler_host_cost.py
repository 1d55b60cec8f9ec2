"""Worker 0's host time per decode step, the model's forward pass taken out: the scheduler (engine/scheduler.py)
and one ModelRunner (tiny preset, CPU) with `decode_forward` replaced by a preset logits tensor, B sequences
of 256 prompt tokens decoding 200 tokens each (greedy). What is left per step is the scheduler's loop, the
KV ledger and pages, the step's inputs, the argmax and the outputs' hand-over: the Python that runs while
the GPU waits for the next step (issue 11 item 4: O(batch) with small constants).

Usage: python scripts/scheduler_host_cost.py [B ...]   (default 1 16 64 256; prints a markdown table)."""
import queue
import random
import sys
import threading
import time

import torch

from burstserve.engine.config import EngineConfig, resolve_model
from burstserve.engine.dispatch import Dispatch
from burstserve.engine.messages import AddRequest, StopScheduler, Tokens
from burstserve.engine.model_runner import ModelRunner
from burstserve.engine.outputs import Request
from burstserve.engine.sampling import SamplingParams
from burstserve.engine.scheduler import Scheduler
from burstserve.engine.worker import run_call

STEPS = 200


def step_times(batch: int) -> tuple[list[float], list[float]]:
    """-> (each decode step's time in DecodeSteps.run, each scheduler iteration's time), seconds."""
    engine = EngineConfig(model="tiny", devices=["cpu"], dtype="float32", max_num_seqs=batch, async_scheduling=False,
                          kv_cache_tokens=batch * 600)
    cfg, max_model_len = resolve_model(engine)
    runner = ModelRunner(engine, cfg, 0, torch.device("cpu"), None, max_model_len)
    logits = torch.randn(batch, cfg.vocab_size)
    runner.decode_forward = lambda step_inputs, num_pages=None: logits[:step_inputs.shape[1]]
    requests, outputs = queue.Queue(), queue.Queue()
    scheduler = Scheduler(Dispatch(lambda message: run_call(runner, message), None), requests, outputs, runner, max_model_len, [])
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    for i in range(batch):
        prompt = [random.randrange(cfg.vocab_size) for _ in range(256)]
        requests.put(AddRequest(Request(str(i), prompt, params, time.time())))
    threading.Thread(target=_shutdown_when_done, args=(outputs, requests, batch), daemon=True).start()
    steps, iterations = [], []
    decode_batch = scheduler.decode.run

    def timed_step(seqs):
        start = time.perf_counter()
        decode_batch(seqs)
        steps.append(time.perf_counter() - start)
        if len(steps) > 1:
            iterations.append(start - timed_step.last)
        timed_step.last = start

    scheduler.decode.run = timed_step
    scheduler.run()
    return steps[5:], iterations[5:]


def _shutdown_when_done(outputs, requests, batch: int) -> None:
    finished = 0
    while finished < batch:
        message = outputs.get()
        if isinstance(message, Tokens):
            finished += sum(o.finish_reason is not None for o in message.items)
    requests.put(StopScheduler())


def main() -> None:
    batches = [int(b) for b in sys.argv[1:]] or [1, 16, 64, 256]
    print("| sequences | decode call, median us | scheduler iteration, median us | per sequence us |")
    print("|---|---|---|---|")
    for b in batches:
        steps, iterations = step_times(b)
        step, iteration = sorted(steps)[len(steps) // 2], sorted(iterations)[len(iterations) // 2]
        print(f"| {b} | {step * 1e6:.0f} | {iteration * 1e6:.0f} | {iteration * 1e6 / b:.1f} |", flush=True)


if __name__ == "__main__":
    main()

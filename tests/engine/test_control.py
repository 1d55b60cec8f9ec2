"""The control plane (engine/control.py): worker 0's calls reach every other worker whole and in order, over
pipes, large ones included; a worker whose peer is gone gets an error, not a hang."""
import dataclasses
import hashlib
import multiprocessing as mp
import random
import time

import pytest
import torch

from burstserve.engine import LLM, EngineDeadError, SamplingParams
from burstserve.engine.control import PipeControl, close_parent_ends, make_pipes
from burstserve.engine.core.calls import Decode, Extend, ExtendAndDecode, Free, Prefill, Shutdown


def _echo(reader, results) -> None:
    """A follower: receives calls until Shutdown, puts each back digested; EOF is reported as ("eof",)."""
    control = PipeControl(reader=reader)
    while True:
        try:
            message = control.receive()
        except EOFError:
            results.put(("eof",))
            return
        if isinstance(message, Shutdown):
            return
        results.put(_digest(message))


def _digest(x):
    """A message with its tensors as their shape and bytes' hash (a queue would share their memory, not copy
    it); a call as its type's name and its fields."""
    if dataclasses.is_dataclass(x):
        return (type(x).__name__,) + tuple(_digest(getattr(x, f.name)) for f in dataclasses.fields(x))
    if isinstance(x, (tuple, list)):
        return tuple(_digest(a) for a in x)
    if not isinstance(x, torch.Tensor):
        return x
    return ("tensor", str(x.dtype), tuple(x.shape),
            hashlib.sha1(x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest())


def _messages(seed):
    rng = random.Random(seed)
    big = torch.randint(0, 128256, (1 << 20,))                    # a 1M-token prompt: 8 MB, past any pipe buffer
    step = Decode([rng.randrange(100) for _ in range(16)], [rng.randrange(50000) for _ in range(16)], list(range(16)))
    return [step,
            Prefill(7, big),
            Free([1, 2]),
            ("odd tensors", torch.randn(5, 3, dtype=torch.bfloat16), torch.randn(4, 6)[:, ::2],    # not contiguous
             torch.empty(0, dtype=torch.int64), torch.tensor(rng.randrange(9)),
             torch.randint(-(1 << 40), 1 << 40, (1 << 17,))),          # int64 beyond int32's range
            ExtendAndDecode(Extend(3, big[: rng.randrange(1, 5000)], rng.randrange(10000)), step)]


def test_pipes_carry_every_call_whole_and_in_order_to_every_worker():
    ctx = mp.get_context("spawn")
    writers, readers = make_pipes(ctx, 3)
    results = [ctx.Queue() for _ in range(2)]
    procs = [ctx.Process(target=_echo, args=(readers[r], results[r - 1]), daemon=True) for r in (1, 2)]
    for p in procs:
        p.start()
    close_parent_ends([], readers)
    control = PipeControl(writers=writers)
    sent = _messages(random.randrange(1 << 20))
    for message in sent:
        control.send(message)
    control.send(Shutdown())
    for queue in results:
        for message in sent:
            assert queue.get(timeout=60) == _digest(message)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0


def test_a_worker_sees_eof_when_worker_0_is_gone_and_worker_0_an_error_when_a_worker_is():
    ctx = mp.get_context("spawn")
    writers, readers = make_pipes(ctx, 2)
    results = ctx.Queue()
    follower = ctx.Process(target=_echo, args=(readers[1], results), daemon=True)
    follower.start()
    close_parent_ends([], readers)
    PipeControl(writers=writers).send(Free([0]))
    assert results.get(timeout=60) == ("Free", (0,))
    writers[0].close()                                  # worker 0 gone: its write end closed everywhere
    assert results.get(timeout=60) == ("eof",)
    follower.join(timeout=30)

    writers, readers = make_pipes(ctx, 2)
    follower = ctx.Process(target=_echo, args=(readers[1], results), daemon=True)
    follower.start()
    close_parent_ends([], readers)
    follower.kill()
    follower.join(timeout=30)
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        PipeControl(writers=writers).send(Decode([1], [2], [3]))


def test_worker_0_killed_ends_the_engine_and_its_workers():
    """Worker 0 gone: the engine raises and no worker is left (the LLM ends them; a worker's own EOF on its
    pipe is the test above)."""
    llm = LLM("tiny", devices="cpu", context_parallel_size=3)
    try:
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2))
        llm._procs[0].kill()
        with pytest.raises(EngineDeadError):
            llm.generate([1, 2, 3] * 50, SamplingParams(max_tokens=20))
        deadline = time.time() + 30
        while any(p.is_alive() for p in llm._procs[1:]) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(p.is_alive() for p in llm._procs[1:])
    finally:
        llm.shutdown()

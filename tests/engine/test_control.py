"""The control plane (engine/control.py): worker 0's calls reach every other worker whole and in order, over
pipes, large ones included; a worker whose peer is gone gets an error, not a hang."""
import hashlib
import multiprocessing as mp
import random
import time

import pytest
import torch

from engine import LLM, EngineDeadError, SamplingParams
from engine.control import PipeControl, close_parent_ends, make_pipes


def _echo(reader, results) -> None:
    """A follower: receives calls until "shutdown", puts each back; EOF is reported as ("eof",)."""
    control = PipeControl(reader=reader)
    while True:
        try:
            name, args = control.receive()
        except EOFError:
            results.put(("eof",))
            return
        if name == "shutdown":
            return
        results.put((name, tuple(_digest(a) for a in args)))


def _digest(x):
    """Tensors travel back as their shape and bytes' hash (a queue would share their memory, not copy it)."""
    if not isinstance(x, torch.Tensor):
        return x
    return ("tensor", str(x.dtype), tuple(x.shape),
            hashlib.sha1(x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest())


def _messages(seed):
    rng = random.Random(seed)
    big = torch.randint(0, 128256, (1 << 20,))                    # a 1M-token prompt: 8 MB, past any pipe buffer
    return [("decode", ([rng.randrange(100) for _ in range(16)], [rng.randrange(50000) for _ in range(16)])),
            ("prefill", (7, big, None)),
            ("info", ()),
            ("odd tensors", (torch.randn(5, 3, dtype=torch.bfloat16), torch.randn(4, 6)[:, ::2],    # not contiguous
                             torch.empty(0, dtype=torch.int64), torch.tensor(rng.randrange(9)),
                             torch.randint(-(1 << 40), 1 << 40, (1 << 17,)))),      # int64 beyond int32's range
            ("extend", (3, big[: rng.randrange(1, 5000)], rng.randrange(10000)))]


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
    for name, args in sent:
        control.send(name, args)
    control.send("shutdown", ())
    for queue in results:
        for name, args in sent:
            got = queue.get(timeout=60)
            assert got[0] == name
            assert got[1] == tuple(_digest(a) for a in args)
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
    PipeControl(writers=writers).send("info", ())
    assert results.get(timeout=60) == ("info", ())
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
        PipeControl(writers=writers).send("decode", ([1], [2]))


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

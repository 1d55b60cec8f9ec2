"""engine/core/calls.py: one message type per call worker 0 makes, each run through the worker's one entry point
(ModelRunner.execute) by one handler that takes exactly that type (a ModelRunner method, or for the cache's
calls a WorkerCache method on the runner's cache); results as their own types."""
import dataclasses
import inspect
import random
import typing

import torch

import burstserve.engine.core.calls as calls
from burstserve.engine.core.outputs import PrefillStats
from burstserve.engine.core.placement import ExtendWay
from burstserve.engine.runner.model_runner import ModelRunner
from burstserve.engine.runner.worker_cache import WorkerCache
from burstserve.engine.runner.model_runner import CACHE_CHANGES, WORK

RESULTS = {calls.PrefillResult, calls.DecodeResult}
PARTS = {calls.ExtendPlacement, calls.SampleNext}   # fields of calls (Extend.placed, Prefill.sample_next), not calls


def _call_types() -> set[type]:
    return {t for _, t in inspect.getmembers(calls, inspect.isclass)
            if dataclasses.is_dataclass(t) and t.__module__ == calls.__name__ and t not in RESULTS | PARTS}


def test_every_call_has_one_handler_that_takes_that_type():
    assert not set(WORK) & set(CACHE_CHANGES)
    assert set(WORK) | set(CACHE_CHANGES) == _call_types() - {calls.Shutdown, calls.Turn}
    assert set(CACHE_CHANGES) == set(calls.CACHE_CHANGES) | {calls.PumpStores}
    for kind, handler in {**WORK, **CACHE_CHANGES}.items():
        owner = WorkerCache if kind in CACHE_CHANGES else ModelRunner
        assert handler is getattr(owner, handler.__name__)
        hints = typing.get_type_hints(handler, localns=vars(calls))
        params = list(inspect.signature(handler).parameters)
        assert params == ["self", "call"], (kind, params)
        assert hints["call"] is kind, (kind, hints["call"])


def test_a_call_reaches_the_handler_of_its_type_with_its_fields(monkeypatch):
    """ModelRunner.execute dispatches by exact type (a DecodeAhead goes to decode_ahead, not to a Decode's
    handler), the runner (its cache for the cache's calls) and the message passed whole, the host tier's stores
    pumped before and after each."""
    seen, pumped = [], []
    for table in (WORK, CACHE_CHANGES):
        for kind, handler in list(table.items()):
            monkeypatch.setitem(table, kind, lambda runner, message, name=handler.__name__:
                                seen.append((name, runner, message)) or name)
    rng = random.Random()
    ids = torch.randint(0, 100, (rng.randrange(1, 50),))
    messages = [calls.Prefill(rng.randrange(9), ids), calls.Extend(1, ids, rng.randrange(100)),
                calls.Decode([1, 2], [3, 4], [5, 6]), calls.DecodeAhead([1], [2], [3], fed_from=[0]),
                calls.Free([rng.randrange(9)]), calls.Adopt(1, 2, rng.randrange(64), [3, 4])]
    cache = type("Cache", (), {"pump_stores": lambda self: pumped.append(len(seen))})()
    runner = type("Runner", (), {"cache": cache, "execute": ModelRunner.execute})()
    assert [runner.execute(m) for m in messages] == ["prefill", "extend", "decode", "decode_ahead", "free", "adopt"]
    assert pumped == [n for i in range(len(messages)) for n in (i, i + 1)]
    owners = [runner] * 4 + [runner.cache] * 2
    assert all(r is owner and got is sent for (_, r, got), sent, owner in zip(seen, messages, owners))


def test_a_prefill_result_reports_its_figures_only():
    seconds = random.random()
    result = calls.PrefillResult(seconds, "burst", setup_seconds=0.01, cached_tokens=0, extend_way=ExtendWay.RING,
                                 graphed=True, logits=torch.zeros(4), decode=calls.DecodeResult([1], torch.zeros(0, 4)))
    assert result.stats() == PrefillStats(prefill_seconds=seconds, strategy="burst", setup_seconds=0.01, cached_tokens=0)

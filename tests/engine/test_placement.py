"""The KV manager places every call (engine/cache/kv_manager.py `place`) and the workers store what they are
told (engine/runner/worker_cache.py): on two CPU workers (gloo), each driving its runner through its own KV manager
as every worker follows worker 0's (engine/worker.py `runner_alone`), after every call of a random run
(prompts, extends run "whole" and "ring", decode steps, a chunk with a decode step, copies of a prompt and of a
prefix, a truncated entry, frees) each worker's pool holds exactly the tokens, on exactly the page ids, the
ledger gives its rank, sequence by sequence, for a sharded strategy and for replicated K/V (tp)."""
import random

import pytest
import torch

from dist_harness import run_on_ranks
from burstserve.engine.core.calls import Adopt, Decode, Extend, ExtendAndDecode, Prefill, Truncate
from burstserve.engine.model.config import EngineConfig, resolve_model


def _placed_run(rank: int, world_size: int, strategy: str, seed: int) -> tuple[list, set]:
    """-> (the mismatches between the ledger's rank and this worker's pool, after which call; the extend ways)."""
    from burstserve.engine.runner.model_runner import ModelRunner
    from burstserve.engine.worker import runner_alone
    engine = EngineConfig(model="tiny", devices=["cpu"] * world_size, sp_strategy=strategy, dtype="float32",
                          block_size=4, max_num_seqs=8, extend_ring_min_tokens=24, kv_cache_tokens=2048)
    cfg, max_model_len = resolve_model(engine)
    runner = ModelRunner(engine, cfg, rank, torch.device("cpu"), None, max_model_len)
    kv, pool = runner_alone(runner), runner.pool
    rng = random.Random(seed)                       # the same draw on every rank: the same calls
    ids = lambda n: torch.tensor([rng.randrange(cfg.vocab_size) for _ in range(n)])   # noqa: E731
    mismatches, ways, length = [], set(), {}

    def check(what: str) -> None:
        held = {s: seq.tokens[rank] for s, seq in kv.ledger.seqs.items()}
        on_pages = {s: seq.pages[rank] for s, seq in kv.ledger.seqs.items()}
        if held != pool.lengths or on_pages != pool.pages or kv.ledger.free_pages()[rank] != pool.free_pages:
            mismatches.append((what, held, dict(pool.lengths), kv.ledger.free_pages()[rank], pool.free_pages))

    def step(seqs: list[int]) -> Decode:
        return Decode(seqs, [1] * len(seqs), [length[s] for s in seqs])

    for s in (0, 1):
        length[s] = rng.randrange(5, 60)
        kv.call(Prefill(s, ids(length[s])))
        check(f"prefill {s}")
    for i in range(rng.randrange(6, 10)):
        small, large = rng.randrange(1, 24), rng.randrange(24, 70)       # "whole" below 24 new tokens, else "ring"
        s, n = rng.choice((0, 1)), (small, large)[i] if i < 2 else rng.choice((small, large))   # both ways, always
        if rng.random() < 0.5:
            result = kv.call(Extend(s, ids(n), length[s]))
        else:
            other = 1 - s
            result = kv.call(ExtendAndDecode(Extend(s, ids(n), length[s]), step([other])))
            length[other] += 1
        ways.add(result.extend_way)
        length[s] += n
        check(f"extend {i} of {s} by {n}")
        for _ in range(rng.randrange(1, 4)):
            kv.call(step([0, 1]))
            length[0], length[1] = length[0] + 1, length[1] + 1
            check("decode")
    kv.fork(0, 2)                                   # a copy of sequence 0's prompt
    check("fork")
    position = rng.randrange(1, length[1])          # a copy of a prefix of sequence 1 (KVManager.adopt's call)
    counts = kv.ledger.add_prefix_of(1, 3, position)
    kv.call(Adopt(1, 3, position, counts, [kv.ledger.page_ids(3, r) for r in range(world_size)]))
    check("adopt")
    keep = rng.randrange(1, length[0])
    kv.call(Truncate(0, keep, kv.ledger.truncate(0, keep)))
    check("truncate")
    kv.free([0, 2])
    check("free")
    return mismatches, ways


@pytest.mark.parametrize("strategy", ["burst", "tp"])
def test_each_worker_stores_what_the_ledger_gives_its_rank(strategy):
    for mismatches, ways in run_on_ranks(_placed_run, 2, strategy, random.randrange(1 << 30), timeout=240):
        assert not mismatches, mismatches[:3]
        if strategy == "burst":                     # both ways a sharded extend runs (a ring passes K/V by default)
            assert "whole" in ways and ways & {"ring", "ring-kv"}, ways

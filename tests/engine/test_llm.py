"""The offline API: sampling, stops, logprobs, limits, batching, prefill figures, bad input, dead workers."""
import json
import os
import random
import time

import pytest
import torch

from burstserve.engine import (LLM, DeviceSpecError, EngineDeadError, InvalidRequestError, ModelLoadError,
                               PromptTooLongError, SamplingParams)
from burstserve.engine.cache.ledger import KVLedger
from hf_reference import assert_same_logprobs, hf_next_logits_and_greedy, save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3"))
    model = save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))
    return path, model


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(checkpoint[0], devices="cpu", context_parallel_size=3, dtype="float32", max_model_len=300) as engine:
        yield engine


def _prompt(n, vocab=320):
    return [random.randrange(vocab) for _ in range(n)]


def test_seed_makes_sampling_reproducible(llm):
    prompt = _prompt(20)
    a, b, c = (llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=s, ignore_eos=True))[0]
               for s in (7, 7, 8))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].token_ids != c.outputs[0].token_ids


def test_top_k_one_is_greedy_and_top_p_keeps_the_top_token(llm):
    prompt = _prompt(30)
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    top_k = llm.generate(prompt, SamplingParams(temperature=0.8, top_k=1, max_tokens=8, seed=1, ignore_eos=True))[0]
    top_p = llm.generate(prompt, SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=8, seed=1, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == top_k.outputs[0].token_ids == top_p.outputs[0].token_ids


def test_stop_token_ids_end_the_output(llm):
    prompt = _prompt(25)
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = full.token_ids[4]
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop],
                                              ignore_eos=True))[0].outputs[0]
    first = full.token_ids.index(stop)
    assert cut.token_ids == full.token_ids[:first + 1] and cut.finish_reason == "stop"


def test_logprobs_match_transformers(llm, checkpoint):
    prompt = _prompt(40)
    ref_logits, ref_tokens = hf_next_logits_and_greedy(checkpoint[1], prompt, 4)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref_tokens
    assert len(out.logprobs) == 4 and all(len(lp) >= 5 and t in lp for lp, t in zip(out.logprobs, out.token_ids))
    ref_logp = torch.log_softmax(ref_logits, dim=-1)
    for token, value in out.logprobs[0].items():
        assert abs(value - ref_logp[token].item()) < 1e-4
    top5 = sorted(out.logprobs[0].values(), reverse=True)[:5]     # values, not ids: near-ties may swap ids
    assert top5 == pytest.approx(ref_logp.topk(5).values.tolist(), abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(out.logprobs, out.token_ids)))


def test_batched_decode_equals_one_at_a_time(llm):
    prompts = [_prompt(n) for n in (1, 5, 17, 64, 150)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_max_model_len_bounds_prompt_and_generation(llm):
    with pytest.raises(PromptTooLongError, match="301 tokens.*max_model_len=300"):
        llm.generate(_prompt(301), SamplingParams(max_tokens=1))
    out = llm.generate(_prompt(295), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_timings_and_ring_figures_are_reported(llm):
    out = llm.generate(_prompt(200), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    m = out.metrics
    assert 0 < m.prefill_seconds <= m.time_to_first_token < 60
    assert len(m.decode_seconds) == 4 and all(d > 0 for d in m.decode_seconds)
    stats = m.prefill_stats
    assert stats.exchange_seconds > 0 and stats.exposed_seconds >= 0 and 0 <= stats.hidden_fraction <= 1
    # where the time to first token goes: the scheduler's call covers set-up, the prefill and wrap-up
    assert stats.setup_seconds >= 0 and stats.wrapup_seconds >= 0 and stats.strategy == "burst"
    parts = stats.setup_seconds + m.prefill_seconds + stats.wrapup_seconds
    assert parts <= stats.call_seconds <= m.time_to_first_token


@pytest.mark.parametrize("bad,param", [
    ([], "prompt"), ([5, 320], "prompt"), ([-1], "prompt"),
])
def test_invalid_prompts_are_named(llm, bad, param):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([bad] if bad else bad)
    assert e.value.param in (param, "prompts")


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(logprobs=21), "logprobs"), (dict(top_k=-3), "top_k"),
])
def test_invalid_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_string_prompt_without_tokenizer_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.generate("hello")


def test_model_directory_errors(tmp_path, checkpoint):
    with pytest.raises(ModelLoadError, match="neither a preset"):
        LLM(str(tmp_path / "missing"), devices="cpu")
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(tmp_path), devices="cpu")
    (tmp_path / "config.json").write_text(open(os.path.join(checkpoint[0], "config.json")).read())
    with pytest.raises(ModelLoadError, match="no weights.*model.safetensors"):
        LLM(str(tmp_path), devices="cpu")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(tmp_path), devices="cpu")


@pytest.mark.parametrize("spec,size", [("cpu:2", None), ("cpu:x", None), ("tpu", None), ("cpu", 0)])
def test_bad_device_strings(spec, size):
    """Every form and message is in test_devices.py; here: LLM refuses them (before any worker starts)."""
    with pytest.raises(DeviceSpecError):
        LLM("tiny", devices=spec, context_parallel_size=size)


def test_device_strings(llm):
    """devices="cpu" with context_parallel_size=3: three worker processes on the CPU."""
    assert llm.engine.devices == ["cpu"] * 3 and llm.engine.world_size == 3


def test_decoded_tokens_go_to_the_worker_holding_fewest():
    ledger = KVLedger(3, 2, 100)
    ledger.add(0, [3, 2, 2], [[(0, 2), (5, 6)], [(2, 3), (6, 7)], [(3, 5)]])     # a 7-token prompt's zigzag shards
    owners = [ledger.advance(0)[0][0] for _ in range(7)]
    assert owners == [1, 2, 0, 1, 2, 0, 1] and ledger.seqs[0].tokens == [5, 5, 4]
    assert ledger.seqs[0].ranges == [[(0, 2), (5, 6), (9, 10), (12, 13)], [(2, 3), (6, 8), (10, 11), (13, 14)],
                                     [(3, 5), (8, 9), (11, 12)]]
    assert [ledger.seqs[0].held_before(r, 9) for r in range(3)] == [3, 3, 3]   # positions < 9: the first slots


def test_a_dead_worker_makes_the_engine_raise():
    llm = LLM("tiny", devices="cpu", context_parallel_size=2)
    try:
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2))
        llm._procs[1].kill()
        start = time.time()
        with pytest.raises(EngineDeadError):
            llm.generate([1, 2, 3] * 50, SamplingParams(max_tokens=20))
        assert time.time() - start < 30
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in llm._procs)


def test_shutdown_ends_every_worker_cleanly(monkeypatch):
    """Every worker leaves on its own (exit code 0, not terminated after the 10 s grace), the graphs'
    release before the process group included (here the extend graphs' CPU stand-in)."""
    from burstserve.engine.runner.extend_graphs import ON_CPU_ENV
    monkeypatch.setenv(ON_CPU_ENV, "1")
    llm = LLM("tiny", devices="cpu", context_parallel_size=2)
    try:
        llm.generate([_prompt(40), _prompt(7)], SamplingParams(max_tokens=3))
    finally:
        start = time.time()
        llm.shutdown()
    assert time.time() - start < 10
    assert [p.exitcode for p in llm._procs] == [0, 0]


def test_release_graphs_resets_every_graph_and_drops_them():
    """ModelRunner.release_graphs: every captured graph reset (which drops its hold on the NCCL
    communicator), both holders emptied and gone, before the worker destroys its process group."""
    from types import SimpleNamespace
    from burstserve.engine.runner.model_runner import ModelRunner

    class Graph:
        was_reset = False

        def reset(self):
            self.was_reset = True
    decode = SimpleNamespace(graphs={1: Graph(), 8: Graph()}, outputs={1: torch.ones(1), 8: torch.ones(8)})
    extend = SimpleNamespace(graphs={(256, 0): Graph()}, outputs={(256, 0): torch.ones(256)})
    graphs = list(decode.graphs.values()) + list(extend.graphs.values())
    runner = SimpleNamespace(graphs=decode, extend_graphs=extend, device=torch.device("cpu"))
    ModelRunner.release_graphs(runner)
    assert all(g.was_reset for g in graphs)
    assert not decode.graphs and not decode.outputs and not extend.graphs and not extend.outputs
    assert runner.graphs is None and runner.extend_graphs is None
    ModelRunner.release_graphs(runner)          # twice, or with no graphs at all: nothing to do


def test_workers_that_differ_in_flash_attn_4_are_refused_by_name():
    """One worker with flash-attn-4 and one without would make different collectives at the first small
    extend (graphs against the eager path) and wait on each other for ever: refused at start, each worker
    saying which side it is on. Workers that agree (all with, all without) start."""
    from burstserve.engine.runner.worker_memory import check_same_kernels
    check_same_kernels(0, torch.device("cpu"), False, False, False)
    check_same_kernels(1, torch.device("cuda:1"), True, True, True)
    with pytest.raises(ModelLoadError, match=r"worker 1 \(cuda:1\): flash-attn-4 runs here but not on every worker"):
        check_same_kernels(1, torch.device("cuda:1"), True, False, True)
    with pytest.raises(ModelLoadError, match=r"worker 0 \(cuda:0\): flash-attn-4 does not run here but runs on other"):
        check_same_kernels(0, torch.device("cuda:0"), False, False, True)


def test_kv_capacity_admission():
    with LLM("tiny", devices="cpu", context_parallel_size=2, kv_cache_tokens=100) as small:  # 6 pages of 16 each
        assert small.kv_capacity_tokens == 192
        with pytest.raises(InvalidRequestError, match="prompt of 150 tokens plus max_tokens 60.*capacity of 192 tokens"):
            small.generate([1] * 150, SamplingParams(max_tokens=60))
        # each fits alone, not together: the second waits for the first to finish, then runs
        outs = small.generate([[1] * 120, [2] * 120], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outs] == [10, 10]
        first, second = (o.metrics for o in outs)
        assert second.first_token_time >= first.finished_time


def test_identical_prompts_share_one_prefill(llm, checkpoint):
    """Requests with the same prompt while it is still running copy its K/V instead of a prefill;
    each still decodes exactly as it would alone (greedy: transformers' tokens; seeded: its own run)."""
    prompt = _prompt(150)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, seed=random.randrange(1 << 20), max_tokens=10, ignore_eos=True,
                             logprobs=3) for _ in range(2)]
    outs = llm.generate([prompt] * 3, [greedy] + seeded)
    assert [bool(o.metrics.prefill_stats.shared_prefill) for o in outs] == [False, True, True]
    assert outs[1].metrics.prefill_seconds == 0.0 and outs[0].metrics.prefill_seconds > 0
    _, ref = hf_next_logits_and_greedy(checkpoint[1], prompt, 10)
    assert outs[0].outputs[0].token_ids == ref
    for out, params in zip(outs[1:], seeded):
        alone = llm.generate(prompt, params)[0]
        assert not alone.metrics.prefill_stats.shared_prefill
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        for shared_step, alone_step in zip(out.outputs[0].logprobs, alone.outputs[0].logprobs):
            assert_same_logprobs(shared_step, alone_step, 1e-5)
    fresh = _prompt(150)               # not in the prefix cache: a cached prompt starts from its copy, in chunks
    _, fresh_ref = hf_next_logits_and_greedy(checkpoint[1], fresh, 10)
    twin_greedy = llm.generate([fresh, fresh], [greedy, greedy])
    assert twin_greedy[1].metrics.prefill_stats.shared_prefill
    assert [o.outputs[0].token_ids for o in twin_greedy] == [fresh_ref, fresh_ref]


def test_a_near_miss_model_name_gets_the_name_it_may_mean(tmp_path):
    with pytest.raises(ModelLoadError, match="did you mean 'llama3-8b'"):
        LLM("llama3-8", devices="cpu")
    with pytest.raises(ModelLoadError, match="did you mean 'smollm2-135m-instruct'"):
        LLM("smollm2-135m-instruc", devices="cpu")
    (tmp_path / "Llama-3.1-8B-Instruct").mkdir()
    with pytest.raises(ModelLoadError, match=f"did you mean '{tmp_path}/Llama-3.1-8B-Instruct'"):
        LLM(str(tmp_path / "Llama-3.1-8B-Instruc"), devices="cpu")
    with pytest.raises(ModelLoadError, match="neither a preset") as refused:
        LLM(str(tmp_path / "something-else"), devices="cpu")
    assert "did you mean" not in str(refused.value)


def test_a_model_directory_without_tokenizer_files_is_said_at_start(tmp_path, caplog):
    from burstserve.engine.core.tokenizer import NoTokenizer, load_tokenizer
    with caplog.at_level("WARNING", logger="burstserve.engine.core.tokenizer"):
        tok = load_tokenizer(str(tmp_path), is_preset=False)
    assert isinstance(tok, NoTokenizer)
    assert "no tokenizer files" in caplog.text and "token ids" in caplog.text

"""The engine's options (engine/options.py): every check, drawn from the table so that a new option is
covered; the CLI, LLM(...) and EngineConfig agreeing on every option's name and default; the checks of
several options and the strategies' refusals, in their words. Nothing here starts a worker."""
import dataclasses
import inspect
import os
import random
import re

import pytest

from burstserve.engine import LLM, InvalidRequestError
from burstserve.engine.model.config import DEFAULT_CHUNK_TOKENS_PER_WORKER, EngineConfig, preset_config
from burstserve.engine.options import BY_NAME, OPTIONS, check_options, cluster_config, engine_config, from_args
from burstserve.engine.parallel import SP_STRATEGIES, STRATEGIES, get_strategy
from burstserve.server.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKED = [o for o in OPTIONS if not o.checked_by]
WRONG_TYPE = {bool: "yes", int: "8", float: "0.5", str: 3}


def _refusal(**options) -> InvalidRequestError:
    """The InvalidRequestError LLM(...) raises for these options (before any device or worker)."""
    with pytest.raises(InvalidRequestError) as e:
        LLM("tiny", devices="cpu", **options)
    return e.value


def _out_of_range(o) -> list:
    """Values each of the option's own constraints refuses (its choices, its bounds)."""
    bad = [f"no-such-{o.name}"] if o.choices else []
    step = 1 if o.type is int else 0.5
    bad += [o.at_least - step] if o.at_least is not None else []
    bad += [o.above] if o.above is not None else []
    return bad + ([o.at_most + step] if o.at_most is not None else [])


def _in_range(o) -> list:
    """Values on the edge of the option's bounds that it takes."""
    good = [o.at_least] if o.at_least is not None else []
    good += [o.above + (1 if o.type is int else 0.01)] if o.above is not None else []
    return good + ([o.at_most] if o.at_most is not None else []) + list(o.choices)


@pytest.mark.parametrize("option", CHECKED, ids=lambda o: o.name)
def test_a_value_of_another_type_is_refused_naming_the_option(option):
    e = _refusal(**{option.name: WRONG_TYPE[option.type]})
    assert e.param == option.name and str(e).startswith(option.name), str(e)
    if not option.nullable:
        assert _refusal(**{option.name: None}).param == option.name


@pytest.mark.parametrize("option", [o for o in CHECKED if _out_of_range(o)], ids=lambda o: o.name)
def test_each_bound_and_choice_refuses_naming_the_option(option):
    for value in _out_of_range(option):
        e = _refusal(**{option.name: value})
        assert e.param == option.name and str(e).startswith(option.name) and str(value) in str(e), str(e)
    for value in _in_range(option):
        assert check_options({option.name: value})[option.name] == value


@pytest.mark.parametrize("name,value,words", [
    ("nnodes", 0, "--nnodes must be at least 1, not 0"),
    ("master_port", 0, "--master-port must be in 1 .. 65534"),
    ("master_port", 65535, "--master-port must be in 1 .. 65534"),
    ("join_timeout", 0.0, "--join-timeout must be positive, not 0.0"),
])
def test_the_cluster_options_are_checked_as_the_cluster_checks_them(name, value, words):
    e = _refusal(**{name: value})
    assert e.param == name and words in str(e), str(e)
    assert all(BY_NAME[n].check for n in ("nnodes", "master_port", "join_timeout"))


def test_the_messages_say_what_is_allowed():
    assert str(_refusal(zero_sliced_max_tokens=-1)) == "zero_sliced_max_tokens must be >= 0, not -1"
    assert str(_refusal(gpu_memory_utilization=0)) == "gpu_memory_utilization must be in (0, 1], not 0"
    assert str(_refusal(itl_target_ms=0)) == "itl_target_ms must be > 0 (or None: no target), not 0"
    assert str(_refusal(sp_strategy="magic")) == f"sp_strategy 'magic' is not one of {', '.join(SP_STRATEGIES)}"
    assert str(_refusal(quantization="int4")) == "quantization 'int4' is not one of none, fp8"
    assert str(_refusal(max_num_seqs=True)) == "max_num_seqs must be an integer, not True"


def test_an_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_sequences'"):
        LLM("tiny", devices="cpu", max_num_sequences=8)


def test_a_chunk_size_without_chunked_prefill_is_refused():
    e = _refusal(max_num_batched_tokens=64, enable_chunked_prefill=False)
    assert e.param == "max_num_batched_tokens" and "enable_chunked_prefill=False turns off" in str(e)
    assert check_options(dict(enable_chunked_prefill=False))["max_num_batched_tokens"] is None


def test_strategies_refuse_options_in_their_words():
    e = _refusal(sp_strategy="burst-zero", quantization="fp8")
    assert e.param == "quantization"
    assert str(e) == "burst-zero gathers bfloat16 weights; --quantization fp8 is not supported with it"
    e = _refusal(sp_strategy="burst-zero", mixed_batch=True)
    assert e.param == "mixed_batch" and "burst-zero runs a chunk on whole weights" in str(e)
    assert "--mixed-batch off" in str(e)
    e = _refusal(sp_strategy="single", nnodes=2)
    assert e.param == "sp_strategy"
    assert str(e) == "--sp-strategy single runs on one device; it cannot span hosts (--nnodes 2)"
    assert check_options(dict(sp_strategy="burst-zero", mixed_batch=False))["mixed_batch"] is False
    for name in SP_STRATEGIES:
        if name != "burst-zero":
            assert STRATEGIES[name].option_refusal(check_options(dict(quantization="fp8", sp_strategy=name))) is None


def test_strategies_refuse_models_their_workers_cannot_split():
    tiny = preset_config("tiny")                            # 4 query heads, 2 K/V heads, MLP 352
    refusals = {name: get_strategy(name, 3).model_refusal(tiny) for name in SP_STRATEGIES}
    assert refusals["ulysses"] == "ulysses splits the 4 attention heads over the workers; 3 workers do not divide them"
    assert refusals["tp"] == refusals["tp-v3"] == ("tp splits the 4 attention heads over the workers; 3 do not "
                                                   "divide them")
    assert {n for n, r in refusals.items() if r} == {"ulysses", "tp", "tp-v3"}
    note = get_strategy("burst-zero", 3).fallback_note(tiny)          # burst-zero keeps the weights whole
    assert note.startswith("--sp-strategy burst-zero: burst-zero splits the MLP width 352; 3 workers")
    assert get_strategy("burst-zero", 3).weight_slices(tiny, 0) == {}
    assert get_strategy("burst-zero", 2).weight_slices(tiny, 0)
    assert not any(get_strategy(name, 2).model_refusal(tiny) for name in SP_STRATEGIES)
    assert {n for n, s in STRATEGIES.items() if s.max_workers} == {"single"} and STRATEGIES["single"].max_workers == 1


def _parse(*argv: str) -> dict:
    return from_args(build_parser().parse_args(list(argv)))


def test_the_cli_and_llm_agree_on_every_option_and_its_default():
    defaults = {o.name: o.default for o in OPTIONS}
    assert _parse("serve") == defaults
    signature = inspect.signature(LLM).parameters
    assert {n: p.default for n, p in signature.items() if n != "model"} == defaults
    assert all(signature[n].kind is inspect.Parameter.KEYWORD_ONLY for n in defaults)
    assert _parse("worker", "--node-rank", "1") == {o.name: o.default for o in OPTIONS if o.on_worker}
    assert check_options({}) == defaults


def _flags(*argv: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[argv[0]]
    return {s for a in sub._actions for s in a.option_strings}


def test_every_option_has_its_flags_on_the_commands_that_take_it():
    serve, worker = _flags("serve"), _flags("worker")
    for o in OPTIONS:
        flags = set(o.cli_flags) | ({"--no-" + o.cli_flags[0][2:]} if o.type is bool and not o.off_flag else set())
        assert flags <= serve, o.name
        assert (flags <= worker) == o.on_worker, o.name


def test_the_flags_keep_their_forms():
    values = _parse("serve", "--no-enable-chunked-prefill", "--no-overlap", "--enforce-eager", "--itl-target-ms", "0",
                    "--no-mixed-batch", "-q", "fp8", "-cp", "2", "--no-async-scheduling", "--no-enable-prefix-caching",
                    "--sp-strategy", "tp", "--join-timeout", "5")
    assert values | dict(enable_chunked_prefill=False, overlap=False, cuda_graphs=False, itl_target_ms=None,
                         mixed_batch=False, quantization="fp8", context_parallel_size=2, async_scheduling=False,
                         enable_prefix_caching=False, sp_strategy="tp", join_timeout=5.0) == values
    assert _parse("serve", "--itl-target-ms", "20", "--mixed-batch")["itl_target_ms"] == 20.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--sp-strategy", "magic"])


def test_every_option_fills_its_engine_config_field():
    """The defaults make EngineConfig's own (but those resolved: dtype by device, the default chunk), and a
    value given to any option named like a field lands in that field."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    engine = engine_config("tiny", ["cpu"], check_options({}))
    resolved = dict(model="tiny", devices=["cpu"], dtype="float32",
                    max_num_batched_tokens=DEFAULT_CHUNK_TOKENS_PER_WORKER)
    assert dataclasses.asdict(engine) == dataclasses.asdict(EngineConfig(**resolved))
    for o in OPTIONS:
        if o.name in fields and o.name not in resolved:
            value = next(v for v in _in_range(o) + [not o.default if o.type is bool else 7] if v != o.default)
            assert getattr(engine_config("tiny", ["cpu"], check_options({o.name: value})), o.name) == value, o.name
    assert engine_config("tiny", ["cuda:0"], check_options({})).dtype == "bfloat16"
    assert engine_config("tiny", ["cpu"], check_options(dict(attention_backend="flash-attn"))).kernel == "flash_attn_4"
    assert engine_config("tiny", ["cpu"], check_options(dict(enable_chunked_prefill=False))).max_num_batched_tokens is None
    cluster = cluster_config(check_options(dict(nnodes=2, master_port=4000)), node_rank=1)
    assert (cluster.nnodes, cluster.node_rank, cluster.master_port, cluster.join_timeout) == (2, 1, 4000, 300.0)


def test_the_default_chunk_is_a_share_for_each_worker_a_prompt_is_sharded_over():
    """Chunked prefill's default chunk is 65536 tokens for each worker a chunk is sharded over (as a prompt
    is), up to two workers' worth; tp runs every chunk whole on each worker, so its chunk stays one share; a
    chunk the user gives, or chunking turned off, is kept as given."""
    def chunk(workers, **options):
        return engine_config("tiny", ["cpu"] * workers, check_options(options)).max_num_batched_tokens
    share = DEFAULT_CHUNK_TOKENS_PER_WORKER
    for workers in (1, 2, 3, 4):
        assert chunk(workers) == chunk(workers, sp_strategy="ulysses") == min(workers, 2) * share
        assert chunk(workers, sp_strategy="tp") == chunk(workers, sp_strategy="tp-v3") == share
    assert chunk(2, sp_strategy="single") == share
    given = random.randrange(1, 1 << 20)
    assert chunk(4, max_num_batched_tokens=given) == given
    assert chunk(4, enable_chunked_prefill=False) is None


def test_the_readme_says_the_cpu_kv_capacity_the_option_has():
    """The README's row of --kv-cache-tokens gives the CPU default the option's help gives (it said "1M on CPU"
    after the default became what 4 GiB of K/V hold)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    row = next(line for line in readme.splitlines() if line.startswith("| `--kv-cache-tokens`"))
    assert "4 GiB" in BY_NAME["kv_cache_tokens"].help and "4 GiB" in row and "1M on CPU" not in row, row


def test_the_readme_flag_table_names_every_option():
    readme = open(os.path.join(ROOT, "README.md")).read()
    for o in OPTIONS:
        for flag in o.cli_flags:
            assert f"`{flag}`" in readme, flag


STRATEGY_NAMES = "|".join(re.escape(n) for n in SP_STRATEGIES if n != "auto")   # "auto" is an attention backend too


def test_no_strategy_name_is_compared_outside_engine_parallel():
    """Code outside engine/parallel/ asks the strategy (PrefillStrategy's attributes and refusals); it never
    compares an --sp-strategy name."""
    compared = re.compile(rf"""(==|!=|\bin\b)\s*\(?[^#]*["']({STRATEGY_NAMES})["']|["']({STRATEGY_NAMES})["']\s*(==|!=|:)""")
    found = []
    for top in ("engine", "server"):
        for folder, _, files in os.walk(os.path.join(ROOT, "burstserve", top)):
            if os.path.join("engine", "parallel") in folder:
                continue
            for name in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                found += [f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}" for i, line in
                          enumerate(open(path), 1) if compared.search(line.split("#")[0])]
    assert not found, "\n".join(found)


def test_version_names_the_installed_package(capsys):
    from importlib.metadata import version
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"burstserve {version('burstserve')}"

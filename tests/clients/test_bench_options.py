"""`burstserve bench`'s engine options (clients/offline_options.py OFFLINE_OPTIONS) are engine/options.py's rows: the
flags, defaults and choices of `burstserve serve` (sweep's --sp-strategy also taking the baselines), every
flag spelling the bench took before still taken, and their values handed to LLM by keyword; and every
`bench` command line of scripts/gpu.sh (its DRY mode printing them) still parses. Nothing here starts a worker."""
import argparse
import os
import shlex
import subprocess

import pytest

from burstserve.clients.bench import BASELINES, OFFLINE_OPTIONS, _device_args
from paths import ROOT
from burstserve.clients.sweep import offline_llm_args
from burstserve.engine.options import BY_NAME, OPTIONS, check_options
from burstserve.server.cli import build_parser

# the flags the bench took before its engine options came from the table: each still there, as that option
OLD_FLAGS = {"--attention-backend": "attention_backend", "--sp-strategy": "sp_strategy", "--dtype": "dtype",
             "--quantization": "quantization", "--max-num-batched-tokens": "max_num_batched_tokens",
             "--no-enable-chunked-prefill": "enable_chunked_prefill", "--no-async-scheduling": "async_scheduling",
             "--zero-sliced-max-tokens": "zero_sliced_max_tokens", "--no-overlap": "overlap",
             "--devices": "devices", "-cp": "context_parallel_size", "--context-parallel-size": "context_parallel_size"}
# bench flags spelled like a serve flag that are not that engine option (documented in their help)
NOT_ENGINE = {"--seed": "shared: the seed of the random token ids", "--model": "the model, LLM's first argument"}


def _mode(parser: argparse.ArgumentParser, mode: str) -> argparse.ArgumentParser:
    bench = next(a for a in parser._actions if a.dest == "command").choices["bench"]
    return next(a for a in bench._actions if a.dest == "mode").choices[mode]


def _serve_flags(o) -> set[str]:
    return set(o.cli_flags) | ({"--no-" + o.cli_flags[0][2:]} if o.type is bool and not o.off_flag else set())


@pytest.mark.parametrize("mode", ["sweep", "shared"])
def test_every_engine_option_of_the_bench_is_the_tables(mode):
    actions = {a.dest: a for a in _mode(build_parser(), mode)._actions}
    for name in OFFLINE_OPTIONS:
        o, a = BY_NAME[name], actions[name]
        assert set(a.option_strings) == _serve_flags(o), name
        assert a.default == o.default, name
        baselines = BASELINES if (name, mode) == ("sp_strategy", "sweep") else ()
        shown = tuple(a.choices or ()) if not o.aliases else tuple(a.metavar.strip("{}").split(","))  # checked by type
        assert shown == tuple(o.choice_names()) + baselines, name
    for flag, name in OLD_FLAGS.items():
        assert next(a for a in actions.values() if flag in a.option_strings).dest == name, flag
    # a bench flag spelled as an engine flag of serve is that option, from the table (not restated by hand)
    engine_flags = {flag: o.name for o in OPTIONS for flag in _serve_flags(o)}
    for a in actions.values():
        for flag in set(a.option_strings) & set(engine_flags):
            assert a.dest == engine_flags[flag] and a.dest in OFFLINE_OPTIONS or flag in NOT_ENGINE, flag


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_the_defaults_reach_llm_as_before_by_keyword():
    """An offline run's LLM arguments with no engine flag: what the bench gave field by field before (chunked
    prefill on, as serve's default), checked as LLM checks them."""
    for mode in ("sweep", "shared"):
        args = _parse(mode, "--offline", "--seed", "7") if mode == "shared" else _parse(mode, "--offline")
        llm_args = offline_llm_args(args, 4096, 16, enable_prefix_caching=True)
        assert llm_args == dict(model="tiny", devices=None, context_parallel_size=None, dtype=None, sp_strategy="burst",
                                attention_backend="auto", overlap=True, max_model_len=4096, max_num_seqs=16,
                                quantization="none", kv_cache_dtype="auto", zero_sliced_max_tokens=None,
                                async_scheduling=True, kv_cache_tokens=None, kv_offload_gb=None,
                                max_num_batched_tokens=None, enable_chunked_prefill=True, extend_pass="kv",
                                enable_prefix_caching=True), mode      # no seed: shared's --seed is the prompts'
        values = check_options({k: v for k, v in llm_args.items() if k != "model"})
        assert values["enable_chunked_prefill"] is True and values["seed"] == BY_NAME["seed"].default


def test_every_flag_reaches_llm_by_keyword():
    args = _parse("sweep", "--offline", "--model", "llama3-8b", "--devices", "cuda", "-cp", "2", "--dtype", "float16",
                  "-q", "fp8", "--kv-cache-dtype", "fp8", "--sp-strategy", "burst-zero", "--attention-backend", "cudnn",
                  "--no-overlap", "--no-async-scheduling", "--no-enable-chunked-prefill", "--zero-sliced-max-tokens", "0",
                  "--extend-pass", "q")
    assert offline_llm_args(args, 100) == dict(
        model="llama3-8b", devices="cuda", context_parallel_size=2, dtype="float16", quantization="fp8",
        kv_cache_dtype="fp8",
        sp_strategy="burst-zero", attention_backend="cudnn", overlap=False, async_scheduling=False,
        enable_chunked_prefill=False, max_num_batched_tokens=None, extend_pass="q", zero_sliced_max_tokens=0,
        max_model_len=100, max_num_seqs=64, kv_cache_tokens=None, kv_offload_gb=None)
    args = _parse("shared", "--offline", "--context-parallel-size", "4", "--quantization", "fp8",
                  "--max-num-batched-tokens", "8192", "--async-scheduling", "--enable-chunked-prefill")
    llm_args = offline_llm_args(args, 100)
    assert (llm_args["context_parallel_size"], llm_args["quantization"], llm_args["max_num_batched_tokens"],
            llm_args["async_scheduling"], llm_args["enable_chunked_prefill"]) == (4, "fp8", 8192, True, True)


def test_values_the_table_refuses_are_refused_when_parsed(capsys):
    for argv in (["sweep", "--max-num-batched-tokens", "0"], ["shared", "--zero-sliced-max-tokens", "-1"],
                 ["sweep", "--sp-strategy", "magic"], ["sweep", "--dtype", "float64"], ["sweep", "-q", "int4"],
                 ["sweep", "--kv-cache-dtype", "fp8_e5m2"],
                 ["shared", "--sp-strategy", "transformers"], ["sweep", "--attention-backend", "flash-attn-9"]):
        with pytest.raises(SystemExit):
            _parse(*argv)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _parse("sweep", "--max-num-batched-tokens", "0")
    assert "argument --max-num-batched-tokens: max_num_batched_tokens must be >= 1, not 0" in capsys.readouterr().err
    for baseline in BASELINES:     # sweep's alone: not engine strategies
        assert _parse("sweep", "--sp-strategy", baseline).sp_strategy == baseline


# scripts/gpu.sh's parts that run `bench`, each with the knobs that turn on its optional runs; DRY=4 prints
# every command instead of running it
GPU_SH_RUNS = [
    ("decode", {"PARTS": "half sweep load", "SYNC_AB": "1"}),
    ("prefix", {"ITL_TARGETS": "20 40"}),
    ("capacity", {"SKIP_TESTS": "1"}),
    ("fp8", {"SKIP_TESTS": "1", "SWEEP": "1"}),
    ("zero", {"PARTS": "8b short 70b"}),
    ("strategies", {}),
    ("bench small-counts", {}),
    ("bench strategies llama3-8b", {}),
    ("bench backends llama3-8b", {}),
    ("8x", {"PARTS": "million"}),
    ("8x", {"PARTS": "scaling"}),
    ("cp", {"CP": "4", "PARTS": "engine long passkv peers two one", "PEERS": "tp torch-cp ulysses auto"}),
]


def _gpu_sh_bench_lines(tmp_path) -> list[list[str]]:
    """Every `python3 -m burstserve.clients.bench ...` command line of GPU_SH_RUNS, as `bench` and its argv after clients.bench."""
    lines = []
    for part, knobs in GPU_SH_RUNS:
        env = dict(os.environ, DRY="4", OUT=str(tmp_path / "gpu-sh"), KIND="cuda", **knobs)
        for k in ("CP", "MODEL", "MODELS", "STRATEGIES", "LENGTHS", "SERVE_EXTRA", "LOAD_EXTRA"):
            env.pop(k, None)
        proc = subprocess.run(["bash", "scripts/gpu.sh", *part.split()], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        printed = [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]
        found = [["bench", *argv[argv.index("burstserve.clients.bench") + 1:]] for argv in printed if "burstserve.clients.bench" in argv]
        assert found, (part, knobs, proc.stdout[-2000:], proc.stderr[-2000:])
        lines += found
    return lines


def test_the_bench_command_lines_of_gpu_sh_parse(tmp_path):
    """Each parses; its --serve arguments (with --devices / -cp added) parse as `serve`'s; an offline engine
    run's LLM arguments pass LLM's checks."""
    lines = _gpu_sh_bench_lines(tmp_path)
    parser = build_parser()
    seen_flags, modes = set(), set()
    for argv in lines:
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"scripts/gpu.sh: `bench {shlex.join(argv[1:])}` does not parse")
        modes.add(args.mode)
        seen_flags |= {a for a in argv if a.startswith("-")}
        if getattr(args, "serve", None):
            try:
                parser.parse_args(["serve", *shlex.split(args.serve), *_device_args(args)])
            except SystemExit:
                pytest.fail(f"scripts/gpu.sh: --serve {args.serve!r} does not parse as serve's arguments")
        if getattr(args, "offline", False) and args.sp_strategy not in BASELINES:
            llm_args = offline_llm_args(args, 1024)
            check_options({k: v for k, v in llm_args.items() if k != "model"})
    assert len(lines) >= 60 and modes == {"sweep", "shared", "interference", "load", "merge"}, (len(lines), modes)
    # the engine flags gpu.sh gives the bench itself (not --serve's): each was among the lines parsed
    assert {"--no-overlap", "--attention-backend", "--quantization", "--zero-sliced-max-tokens",
            "--no-async-scheduling", "--sp-strategy", "--devices", "-cp"} <= seen_flags, seen_flags
    assert {"transformers", "torch-cp"} <= {a for argv in lines for a in argv}


@pytest.mark.parametrize("argv", [
    # a few of gpu.sh's lines as written there, its knobs at their defaults
    "sweep --offline --model llama3-8b --devices cuda -cp 1 --output-len 128 --repeats 1 --warmup 1 --lengths 8192 "
    "--label 'engine, 1 GPU, 1 stream-sync' --no-async-scheduling --output-dir out/engine-1x8K-sync",
    "sweep --offline --devices cuda -cp 2 --model llama3-8b --sp-strategy burst-zero --lengths 1024,2048,4096,8192 "
    "--repeats 3 --warmup 1 --sp-strategy burst-zero --zero-sliced-max-tokens 0 --label short-burst-zero-gathered "
    "--output-dir out/short",
    "sweep --offline --model llama3-8b --devices cuda -cp 4 --repeats 2 --warmup 1 --sp-strategy burst --no-overlap "
    "--lengths 32768,131072 --label 'burst, no overlap, 4 GPU' --output-dir out/nolap",
    "sweep --offline --model llama3-8b --devices cuda -cp 4 --repeats 2 --warmup 1 --sp-strategy burst "
    "--attention-backend cudnn --lengths 8192 --label 'burst, cudnn, 4 GPU' --output-dir out/cudnn",
    "sweep --offline --model llama3-8b --devices cuda -cp 1 --lengths 8192,32768,131072 --repeats 2 --warmup 1 "
    "--quantization fp8 --output-dir out/sweep-fp8",
    "sweep --offline --devices cuda -cp 8 --model llama3-8b --sp-strategy torch-cp --lengths 1048576 --repeats 1 "
    "--warmup 0 --label torch-cp-8-million --output-dir out/torch-cp",
    "shared --offline --model llama3-8b --devices cuda -cp 1 --doc-len 131072 --question-len 512 --questions 3 "
    "--repeats 1 --warmup 1 --output-dir out/shared-128K",
    "interference --serve '--model llama3-8b --devices cuda -cp 1  --no-enable-chunked-prefill' --streams 8 "
    "--stream-len 1024 --long-len 131072 --short-len 1024 --short-delay 0.5 --warmup 1 --repeats 1 --label unchunked "
    "--output-dir out/unchunked",
])
def test_gpu_sh_command_lines_listed_here_parse(argv):
    args = _parse(*shlex.split(argv))
    if getattr(args, "offline", False) and args.sp_strategy not in BASELINES:
        check_options({k: v for k, v in offline_llm_args(args, 1024).items() if k != "model"})


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--lengths", "256"]])
def test_bench_without_a_mode_says_that_a_mode_comes_first(argv, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and "takes a mode first" in err and "bench sweep --lengths" in err, err


@pytest.mark.parametrize("mode", ["sweep", "load", "shared", "interference"])
def test_every_flag_of_a_mode_says_what_it_does_and_its_default(mode):
    """Each flag has help; a flag whose default is a value says it (%(default)s or the value in words)."""
    parser = _mode(build_parser(), mode)
    silent = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert not silent, silent
    unsaid = [a.option_strings for a in parser._actions if a.option_strings and a.default not in (None, False, True)
              and a.default != argparse.SUPPRESS and "default" not in a.help.lower() and "%(default)" not in a.help]
    assert not unsaid, unsaid


def test_the_machine_is_this_hosts_only_where_the_server_is_local():
    from burstserve.clients.bench import _is_this_host
    assert _is_this_host("http://127.0.0.1:8000") and _is_this_host("http://localhost:8000/")
    assert _is_this_host("http://[::1]:8000")
    assert not _is_this_host("http://10.1.2.3:8000") and not _is_this_host("http://gpu-box:8000")
    assert not _is_this_host(None)

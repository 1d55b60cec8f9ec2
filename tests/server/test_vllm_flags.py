"""vLLM users' habits on `burstserve serve` (server/vllm_flags.py, the dtype option's aliases): each flag becomes
this engine's own option, and a contradiction is refused naming both flags."""
import pytest

from burstserve.engine.options import check_options
from burstserve.server.cli import parse_command_line


def serve(*argv: str):
    return parse_command_line(["serve", *argv])


def test_a_positional_model_is_the_model_and_the_default_stays_tiny():
    assert serve("/models/x").model == "/models/x"
    assert serve("--model", "/models/x").model == "/models/x"
    assert serve("/models/x", "--model", "/models/x").model == "/models/x"
    assert serve().model == "tiny"
    assert parse_command_line(["worker", "/models/x", "--node-rank", "1"]).model == "/models/x"


def test_a_model_named_twice_differently_is_refused(capsys):
    with pytest.raises(SystemExit) as done:
        serve("/models/x", "--model", "/models/y")
    assert done.value.code == 2 and "named twice" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["-tp", "--tensor-parallel-size"])
def test_tensor_parallel_size_is_the_tp_strategy_over_n_workers(flag):
    args = serve(flag, "2")
    assert (args.sp_strategy, args.context_parallel_size) == ("tp", 2)
    args = serve(f"{flag}=3", "--sp-strategy", "tp", "-cp", "3")
    assert (args.sp_strategy, args.context_parallel_size) == ("tp", 3)
    args = serve("--sp-strategy", "ulysses", "-cp", "2")           # without it nothing changes
    assert (args.sp_strategy, args.context_parallel_size) == ("ulysses", 2)


@pytest.mark.parametrize("argv,named", [(["-tp", "2", "--sp-strategy", "burst"], "--sp-strategy burst"),
                                        (["-tp", "2", "-cp", "4"], "-cp 4"), (["-tp", "0"], "at least 1")])
def test_tensor_parallel_size_against_a_contradiction_is_refused(argv, named, capsys):
    with pytest.raises(SystemExit) as done:
        serve(*argv)
    assert done.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("given,dtype", [("auto", None), ("half", "float16"), ("float", "float32"),
                                         ("bfloat16", "bfloat16")])
def test_dtype_takes_vllms_names(given, dtype):
    assert serve("--dtype", given).dtype == dtype
    assert check_options({"dtype": given})["dtype"] == dtype      # LLM(dtype="auto") as well


def test_an_unknown_dtype_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        serve("--dtype", "fp64")
    err = capsys.readouterr().err
    assert "invalid choice: 'fp64'" in err and "auto" in err and "bfloat16" in err


def test_trust_remote_code_is_accepted_and_disable_log_stats_stops_the_stats_lines():
    assert serve("--trust-remote-code").trust_remote_code
    assert serve("--disable-log-stats").log_stats_interval == 0
    assert serve().log_stats_interval == 10

"""What a vLLM user types, on `burstserve serve` and `burstserve worker`: the model as a positional argument
(`vllm serve MODEL`), `--tensor-parallel-size N` / `-tp N` (here `--sp-strategy tp -cp N`),
`--trust-remote-code` (accepted; nothing of a checkpoint's code is ever run) and `--disable-log-stats`
(`--log-stats-interval 0`). `--dtype auto` is the dtype option's own alias (engine/options.py)."""
import argparse

from burstserve.engine.parallel import TensorParallelStrategy

DEFAULT_MODEL = "tiny"


def add_vllm_flags(p: argparse.ArgumentParser, log_stats: bool) -> None:
    """The flags above on a `serve` or `worker` parser; log_stats: the parser has --log-stats-interval."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="vLLM's tensor parallelism: the same as --sp-strategy tp -cp N (heads and MLP split over "
                        "N workers, K/V whole on each); this engine's own way to use N GPUs is -cp N")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines and unused: burstserve runs its own code for the "
                        "architectures it supports, never code a checkpoint carries")
    if log_stats:
        p.add_argument("--disable-log-stats", action="store_true",
                       help="no log lines on throughput, requests and KV usage (the same as --log-stats-interval 0)")


def apply_vllm_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Turns the flags above into this engine's options in `args`; a contradiction is argparse's error
    (exit 2) naming both flags. argv: the command line as given (to tell a flag given from its default)."""
    given = {a.split("=")[0] for a in argv if a.startswith("-")}
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"the model is named twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.model is None:
        args.model = DEFAULT_MODEL
    tp = args.tensor_parallel_size
    if tp is not None:
        if tp < 1:
            parser.error(f"--tensor-parallel-size must be at least 1, not {tp}")
        tp_name = TensorParallelStrategy.name
        if "--sp-strategy" in given and args.sp_strategy != tp_name:
            parser.error(f"--tensor-parallel-size {tp} is --sp-strategy tp -cp {tp}, but --sp-strategy "
                         f"{args.sp_strategy} was given too: give one or the other")
        if args.context_parallel_size is not None and args.context_parallel_size != tp:
            parser.error(f"--tensor-parallel-size {tp} is --sp-strategy tp -cp {tp}, but -cp "
                         f"{args.context_parallel_size} was given too: give one or the other")
        args.sp_strategy, args.context_parallel_size = tp_name, tp
    if getattr(args, "disable_log_stats", False):
        args.log_stats_interval = 0.0

"""`burstserve bench`: prefill-latency sweeps, load tests and shared-document (prefix cache) TTFT, against a
server or offline.

    burstserve bench sweep --url http://127.0.0.1:8000 --lengths 4096,8192 --repeats 3 --output-dir out
    burstserve bench sweep --serve "--model llama3-8b --devices cuda --sp-strategy ring-rsa" --label ring-rsa
    burstserve bench sweep --offline --model llama3-8b --devices cuda -cp 4 --sp-strategy burst
    burstserve bench load --url ... --num-prompts 200 --input-len 4096 --output-len 128 --request-rate 4
    burstserve bench sweep --offline --model llama3-8b --devices cuda --sp-strategy transformers
    burstserve bench sweep --offline --model llama3-8b --devices cuda -cp 2 --sp-strategy torch-cp
    burstserve bench sweep --offline --model llama3-8b --devices cuda --lengths 8192 --output-len 128 --batch 16
    burstserve bench sweep --offline --model llama3-8b --devices cuda --sp-strategy transformers \
        --lengths 8192 --output-len 128 --batch 16
    burstserve bench shared --serve "--model llama3-8b --devices cuda --enable-prefix-caching" --doc-len 32768 \
        --question-len 512 --questions 4 --repeats 2
    burstserve bench shared --offline --model llama3-8b --devices cuda --doc-len 65536 --max-num-batched-tokens 8192
    burstserve bench shared --url http://127.0.0.1:8000 --turns 6 --doc-len 8192 --question-len 256 --output-len 128
    burstserve bench interference --serve "--model llama3-8b --devices cuda --max-num-batched-tokens 8192" \
        --streams 8 --long-len 131072 --short-len 1024
    burstserve bench merge out-a/results.json out-b/results.json --output-dir merged \
        --doc merged/README.md --section llama3-8b --title "llama3-8b, every strategy"
"""
import argparse
import asyncio
import contextlib
import datetime
import shlex
import sys
from dataclasses import replace

from burstserve.clients import report
from burstserve.clients.offline_options import OFFLINE_OPTIONS
from burstserve.engine.options import BY_NAME, Option, add_arguments
ADDED_TO_SERVE = ("devices", "context_parallel_size")     # _device_args
# `bench sweep --sp-strategy` takes these too, beside the engine's strategies: transformers' model run as a
# user would, the engine not started (clients/hf_baseline.py, clients/torch_cp.py)
BASELINES = ("transformers", "torch-cp")
BASELINES_HELP = ("; or a baseline, not the engine: `transformers` (LlamaForCausalLM on one device) or `torch-cp` "
                  "(LlamaForCausalLM under PyTorch's context_parallel on the GPUs named)")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark time to first token (sweep; shared: cold and warm, prefix cache) or "
                                      "a request load")
    modes = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    p.error = _naming_the_modes(p.error)
    sweep = modes.add_parser("sweep", help="TTFT over prompt lengths (with --output-len, time per output token; "
                                           "with --batch, generated tokens/s)")
    load = modes.add_parser("load", help="many requests at a rate; vllm bench serve's metrics")
    shared = modes.add_parser("shared", help="cold and warm TTFT of questions on one long document (prefix cache), "
                                             "or of a multi-turn conversation (--turns)")
    interference = modes.add_parser("interference", help="what a long prompt's prefill does to decoding streams "
                                                         "and to a short request arriving during it (HTTP)")
    for m in (sweep, load, shared, interference):
        m.add_argument("--url", default=None, help="a running server (default: --serve, else http://127.0.0.1:8000)")
        m.add_argument("--serve", default=None, help="start `burstserve serve` with these arguments for this run")
        m.add_argument("--api-key", default=None, help="the server's --api-key, sent as a bearer token")
        m.add_argument("--label", default=None, help="the configuration's name in tables and plots")
        m.add_argument("--output-dir", default="bench-out", help="where results.json, .csv, .md and plots go "
                                                                 "(default: %(default)s)")
    sweep.add_argument("--lengths", default=",".join(str(n) for n in _default_lengths()),
                       help="prompt lengths in tokens, comma-separated (default: %(default)s; the long ones take "
                            "hours on a CPU)")
    sweep.add_argument("--repeats", type=int, default=3, help="measured requests (batches) per length (default: "
                                                                 "%(default)s)")
    sweep.add_argument("--warmup", type=int, default=1,
                       help="unmeasured requests (batches) per length first (a new length builds kernel plans); "
                            "recorded apart (default: %(default)s)")
    sweep.add_argument("--output-len", "--max-tokens", dest="output_len", type=_positive_int, default=1,
                       metavar="N",
                       help="tokens each request generates, exactly (ignore_eos). 1 (default): TTFT only; N > 1: "
                            "also time per output token, (end-to-end - TTFT) / (N - 1), mean/p50/p99, and "
                            "generated tokens/s. --max-tokens is its old name")
    sweep.add_argument("--batch", type=_positive_int, default=1, metavar="B",
                       help="prompts of the same length sent together: offline one generate call with B prompts, "
                            "over HTTP B concurrent streams (default 1). Every request's TTFT and TPOT is a sample")
    _add_offline_args(sweep, baselines=True)
    shared.add_argument("--doc-len", type=_positive_int, default=32768, metavar="L",
                        help="tokens of the document (random ids, fresh each repeat); multi-turn: of the first turn's "
                             "context")
    shared.add_argument("--question-len", type=_positive_int, default=512, metavar="Q",
                        help="new tokens of each question (multi-turn: of each turn)")
    shared.add_argument("--questions", type=_at_least(2), default=4,
                        help="questions on each document: the first is cold, the others warm")
    shared.add_argument("--documents", type=_positive_int, default=1, metavar="D",
                        help="1 (default): document mode; D >= 2: many-documents mode, D documents each prefilled once, "
                             "then --rounds rounds of a question per document round robin; TTFT by where the prefix "
                             "came from (the GPU's KV pool, the KV host tier, none)")
    shared.add_argument("--rounds", type=_positive_int, default=3, metavar="R",
                        help="many-documents mode: rounds of questions after the documents' first")
    shared.add_argument("--turns", type=_turns, default=0, metavar="T",
                        help="0 (default): document mode; T >= 2: a conversation of T turns, each turn's prompt the "
                             "previous prompt, its answer and --question-len new tokens")
    shared.add_argument("--output-len", type=_positive_int, default=None, metavar="N",
                        help="tokens each request generates, exactly (ignore_eos): the answer of a turn. Default: 1 "
                             "in document mode, 128 in multi-turn mode")
    shared.add_argument("--repeats", type=_positive_int, default=2,
                        help="measured documents (conversations), each fresh")
    shared.add_argument("--warmup", type=int, default=1,
                        help="unmeasured documents (conversations) first: the first prefill of a length and the first "
                             "cached prefill build kernel plans; recorded apart")
    shared.add_argument("--seed", type=int, default=0, help="of the random token ids")
    _add_offline_args(shared)
    _add_interference_args(interference)
    load.add_argument("--num-prompts", type=_positive_int, default=100, metavar="N",
                      help="requests sent in all (default: %(default)s)")
    load.add_argument("--input-len", type=_positive_int, default=1024, metavar="L",
                      help="prompt tokens of each request, random ids (default: %(default)s)")
    load.add_argument("--output-len", type=_positive_int, default=128, metavar="N",
                      help="tokens each request generates, exactly (ignore_eos; default: %(default)s)")
    load.add_argument("--request-rate", type=float, default=float("inf"), metavar="R",
                      help="requests a second, arriving as a Poisson process; inf (default): all at once")
    load.add_argument("--max-concurrency", type=_positive_int, default=None, metavar="C",
                      help="requests in flight at most (default: no limit)")
    load.add_argument("--seed", type=int, default=0, help="of the random token ids and arrival times "
                                                          "(default: %(default)s)")
    for m in (sweep, load, shared, interference):
        _say_defaults(m)
    merge = modes.add_parser("merge", help="several sweeps' results.json into one table and plot")
    merge.add_argument("paths", nargs="+")
    merge.add_argument("--output-dir", default="bench-merged")
    merge.add_argument("--lengths", default=None, help="only these prompt lengths (comma-separated)")
    merge.add_argument("--doc", default=None, help="also write the tables into this markdown file's section")
    merge.add_argument("--section", default=None, help="the section's name (replaced on a rerun); default: title")
    merge.add_argument("--title", default="Time to first token")
    merge.add_argument("--scaling-length", type=int, default=65536,
                       help="the prompt length of the scaling table (configurations by device count); 0: none")


def _say_defaults(parser: argparse.ArgumentParser) -> None:
    """Each flag whose default is a value and whose help does not say it gets "(default: ...)" (as argparse's
    ArgumentDefaultsHelpFormatter, without restating defaults the help already words)."""
    for a in parser._actions:
        if a.option_strings and a.default not in (None, True, False, argparse.SUPPRESS) and a.help \
                and "default" not in a.help.lower():
            a.help += " (default: %(default)s)"


MODES_HINT = ("burstserve bench takes a mode first, then its flags: sweep, load, shared, interference or merge "
              "(e.g. `burstserve bench sweep --lengths 8192`; `burstserve bench MODE --help` lists a mode's flags)")


def _naming_the_modes(error):
    """bench's parser error, saying that a mode comes first where none was named (`bench --lengths 8192`)."""
    def error_naming_the_modes(message: str):
        if "argument MODE" in message or "required: MODE" in message:
            message = f"{message}\n{MODES_HINT}"
        error(message)
    return error_naming_the_modes


def _add_interference_args(m) -> None:
    m.set_defaults(offline=False)
    m.add_argument("--streams", type=_positive_int, default=8, help="background streams decoding meanwhile")
    m.add_argument("--stream-len", type=_positive_int, default=1024, help="prompt tokens of each stream")
    m.add_argument("--stream-output-len", type=_positive_int, default=100000,
                   help="tokens each stream may generate (ignore_eos); it must outlast the measurement, which "
                        "cancels the streams at its end")
    m.add_argument("--long-len", type=_positive_int, default=131072, help="tokens of the long prompt (1 output token)")
    m.add_argument("--short-len", type=int, default=1024,
                   help="tokens of the short request sent --short-delay after the long one (0: none)")
    m.add_argument("--short-delay", type=float, default=0.5, help="seconds after the long prompt")
    m.add_argument("--settle", type=float, default=1.0,
                   help="seconds the streams decode after each has its first token, before the long prompt")
    m.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                   help="each round first sends the long prompt alone on the idle server (its TTFT alone)")
    m.add_argument("--warmup", type=int, default=1, help="unmeasured long prompts alone first (kernel plans)")
    m.add_argument("--repeats", type=_positive_int, default=1, help="measured rounds")
    m.add_argument("--seed", type=int, default=0, help="of the random token ids")


def _add_offline_args(m, baselines: bool = False) -> None:
    """A mode's flags of an offline run (the LLM in this process) and of the devices --serve is given: the
    engine's from its option table (OFFLINE_OPTIONS), --sp-strategy with the BASELINES if `baselines`."""
    m.add_argument("--offline", action="store_true", help="through the LLM API in this process, no HTTP")
    m.add_argument("--model", default="tiny", help="offline: model directory or preset (default: %(default)s)")
    add_arguments(m, offline_option_rows(baselines), checked=True)


def offline_option_rows(baselines: bool = False) -> list[Option]:
    """OFFLINE_OPTIONS as the bench takes them: the table's rows, their help saying where they apply (and,
    with `baselines`, --sp-strategy's choices and help with BASELINES added)."""
    rows = []
    for name in OFFLINE_OPTIONS:
        o = BY_NAME[name]
        where = "offline, or added to --serve's arguments" if name in ADDED_TO_SERVE else \
            "offline (over HTTP: in --serve's arguments)"
        if name == "sp_strategy" and baselines:
            o = replace(o, choices=o.choices + BASELINES, help=o.help + BASELINES_HELP)
        rows.append(replace(o, help=f"{where}: {o.help}"))
    return rows


def _at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value
    return parse


def _turns(text: str) -> int:
    value = int(text)
    if value != 0 and value < 2:
        raise argparse.ArgumentTypeError(f"0 (document mode) or at least 2, not {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _default_lengths() -> list[int]:
    from burstserve.clients.sweep import DEFAULT_LENGTHS
    return DEFAULT_LENGTHS


def run(args) -> None:
    """Runs the chosen mode; a BurstServeError (bad devices, model, request) is one line on stderr, exit 2."""
    from burstserve.engine.core.errors import BurstServeError
    try:
        _run(args)
    except BurstServeError as e:
        print(f"burstserve bench: error: {e}", file=sys.stderr)
        sys.exit(2)


def _run(args) -> None:
    from tqdm import tqdm
    if args.mode == "merge":
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
        rows, runs = report.merge(args.paths, args.output_dir, lengths)
        print(report.sweep_table(rows, {}))
        if args.doc:
            report.write_doc_section(args.doc, args.section or args.title, args.title, runs, rows,
                                     args.output_dir, args.scaling_length)
        return
    if getattr(args, "offline", False):
        _check_offline_devices(args)      # before any file is written
    with _server(args) as url:
        if args.mode == "sweep":
            lengths = [int(x) for x in args.lengths.split(",")]
            meta = {**_run_meta(args, url), "repeats": args.repeats, "warmup": args.warmup,
                    "output_len": args.output_len, "batch": args.batch}
            rows = []
            with tqdm(total=len(lengths) * (args.repeats + args.warmup), desc="sweep", file=sys.stderr) as bar:
                # written as it goes, with the length being measured marked: a killed run keeps its rows
                report.write_sweep(args.output_dir, [report.unfinished_row(args, lengths[0], None)], meta)
                for row in _sweep_rows(args, url, lengths, bar):
                    rows.append(row)
                    pending = [report.unfinished_row(args, lengths[len(rows)], row)] if len(rows) < len(lengths) \
                        else []
                    report.write_sweep(args.output_dir, rows + pending, meta)
            report.write_sweep(args.output_dir, rows, meta)
            print(report.sweep_table(rows, meta) + report.failures(rows) + report.decode_table(rows))
        elif args.mode == "shared":
            from burstserve.clients.shared import run_shared
            run_shared(args, url, _run_meta(args, url))
        elif args.mode == "interference":
            from burstserve.clients.prefill_interference import run_interference
            run_interference(args, url, _run_meta(args, url))
        else:
            from burstserve.clients.load import run_load
            from burstserve.clients.sweep import server_info
            info = server_info(url, args.api_key)
            with tqdm(total=args.num_prompts, desc="load", file=sys.stderr) as bar:
                result = asyncio.run(run_load(url, info["id"], info.get("vocab_size", 1000), args.num_prompts,
                                              args.input_len, args.output_len, args.request_rate,
                                              args.max_concurrency, args.api_key, bar, args.seed))
            result.update(label=args.label, input_len=args.input_len, output_len=args.output_len,
                          num_prompts=args.num_prompts, server=info, **_run_meta(args, url))
            report.write_load(args.output_dir, result)
            print(open(f"{args.output_dir}/results.md").read())


def _sweep_rows(args, url: str | None, lengths: list[int], bar):
    """The chosen sweep's rows, one per prompt length, as they are measured."""
    if args.offline and args.sp_strategy == "transformers":
        from burstserve.clients.hf_baseline import sweep_transformers
        return sweep_transformers(args.model, args.devices, args.dtype, lengths, args.repeats, args.warmup,
                                  args.label, bar, args.context_parallel_size, args.output_len, args.batch)
    if args.offline and args.sp_strategy == "torch-cp":
        from burstserve.clients.torch_cp import sweep_torch_cp
        return sweep_torch_cp(args.model, args.devices, args.dtype, lengths, args.repeats, args.warmup,
                              args.label, bar, args.context_parallel_size, args.output_len, args.batch)
    from burstserve.clients.sweep import offline_llm_args, sweep_http, sweep_offline
    if args.offline:
        llm_args = offline_llm_args(args, max(lengths) + args.output_len, max(64, args.batch))
        return sweep_offline(llm_args, lengths, args.repeats, args.warmup, args.output_len, args.label, bar,
                             args.batch)
    return sweep_http(url, lengths, args.repeats, args.warmup, args.output_len, args.label, args.api_key, bar,
                      args.batch)


def _run_meta(args, url: str | None) -> dict:
    """What results.json records of every run: the command, where it measured, the date and the machine."""
    offline = getattr(args, "offline", False)
    return {"command": "burstserve bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
            "url": None if offline else url, "date": datetime.date.today().isoformat(),
            "machine": report.this_machine() if offline or args.serve or _is_this_host(url)
            else f"unknown: the server at {url}, on another host"}


def _is_this_host(url: str | None) -> bool:
    """Whether `url` is served on this host (a loopback address), so this host's machine is the server's."""
    import ipaddress
    from urllib.parse import urlsplit
    host = urlsplit(url or "").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _device_args(args) -> list[str]:
    """The sweep's --devices / --context-parallel-size, as arguments of the server --serve starts."""
    devices, size = getattr(args, "devices", None), getattr(args, "context_parallel_size", None)
    return (["--devices", devices] if devices else []) + \
        (["--context-parallel-size", str(size)] if size is not None else [])


def _check_offline_devices(args) -> None:
    """Raises DeviceSpecError if --devices / --context-parallel-size cannot run on this machine."""
    from burstserve.engine.core.devices import resolve_devices
    from burstserve.engine.core.errors import InvalidRequestError
    if args.sp_strategy in BASELINES:
        if getattr(args, "quantization", "none") != "none":
            raise InvalidRequestError(f"--quantization is the engine's: --sp-strategy {args.sp_strategy} runs "
                                      "transformers' model as a user would, in --dtype", "quantization")
        if args.sp_strategy == "torch-cp":
            from burstserve.clients.torch_cp import check_torch_cp
            lengths = [int(x) for x in args.lengths.split(",")] if getattr(args, "lengths", None) else []
            check_torch_cp(args.devices, args.context_parallel_size, getattr(args, "output_len", 1),
                           getattr(args, "batch", 1), lengths)
            return
        from burstserve.clients.hf_baseline import baseline_device
        baseline_device(args.devices, args.context_parallel_size)
    else:
        devices = resolve_devices(args.devices, args.context_parallel_size)
        _check_quantization(args, devices)


def _check_quantization(args, devices: list[str]) -> None:
    """--quantization that cannot run on these devices: refused before any file is written."""
    from burstserve.engine.model.config import default_dtype
    from burstserve.engine.core.errors import DeviceSpecError
    from burstserve.kernels.fp8 import quantization_refusal
    dtype = args.dtype or default_dtype(devices)
    refusal = quantization_refusal(getattr(args, "quantization", "none"), devices, dtype)
    if refusal:
        raise DeviceSpecError(refusal)


@contextlib.contextmanager
def _server(args):
    """The URL to measure: --url, a server started from --serve for this run, or the default port."""
    if getattr(args, "offline", False):
        yield None
        return
    if args.serve:
        from burstserve.clients.server_process import RemoteServer
        from burstserve.engine.core.errors import BurstServeError
        try:
            server = RemoteServer(shlex.split(args.serve) + _device_args(args), api_key=args.api_key)
        except RuntimeError as e:    # the server logged why (bad devices: one line)
            raise BurstServeError(f"--serve {args.serve!r}: {e}; its log above says why") from None
        try:
            yield server.url("").rstrip("/")
        finally:
            server.stop()
        return
    url = (args.url or "http://127.0.0.1:8000").rstrip("/")
    _check_reachable(url)
    yield url


def _check_reachable(url: str) -> None:
    """One GET /health first: a server that is not there is one line naming the URL, not a transport traceback."""
    import httpx
    from burstserve.engine.core.errors import BurstServeError
    try:
        httpx.get(f"{url}/health", timeout=10)
    except httpx.HTTPError as e:
        raise BurstServeError(f"no server answers at {url} ({type(e).__name__}: {e}): start one with `burstserve "
                              f"serve`, give its address with --url, or let --serve ARGS start one for this "
                              f"run") from None


def main(argv: list[str] | None = None) -> None:
    """`python -m burstserve.clients.bench MODE ...`: `burstserve bench MODE ...` from a checkout that was not installed."""
    parser = argparse.ArgumentParser(prog="burstserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    run(parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    main()

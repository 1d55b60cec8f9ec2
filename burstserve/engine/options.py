"""The engine's options, each defined once (OPTIONS): its name, type, default, help and check.

Everything that takes engine options is made from this table:
  - the `burstserve serve` / `burstserve worker` flags (`add_arguments`): --name-with-dashes unless
    `flags` says otherwise; a bool is --name / --no-name, or the one `off_flag` that turns it off;
  - LLM's keyword arguments (`check_options`): each value checked against its own option, then the
    checks that involve several (CROSS_CHECKS, and the chosen strategy's own: PrefillStrategy.
    option_refusal), every refusal an InvalidRequestError naming the option by its keyword;
  - the EngineConfig sent to the workers (`engine_config`) and the ClusterConfig (`cluster_config`):
    an option named like one of their fields fills it.
An option's default is written where the engine keeps it: the EngineConfig (or ClusterConfig) field of
its name, unless the table gives one (an option that is not such a field, or whose unset value is
resolved here, as dtype's by device).
"""
import argparse
import dataclasses
import inspect
import numbers
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from burstserve.engine.cluster import ClusterConfig
from burstserve.engine.core.errors import InvalidRequestError
from burstserve.engine.model.config import (DEFAULT_CHUNK_TOKENS_PER_WORKER, DEFAULT_CHUNK_WORKERS_MAX, DTYPES, EngineConfig,
                                      default_chunk_tokens, default_dtype)
from burstserve.engine.parallel import SP_STRATEGIES, STRATEGIES
from burstserve.kernels.attention import ATTENTION_BACKENDS
from burstserve.kernels.fp8 import QUANTIZATIONS
from burstserve.kernels.kv_quant import KV_CACHE_DTYPES

FROM_CONFIG = object()   # the default of the EngineConfig or ClusterConfig field of the option's name
_CONFIG_DEFAULTS = {f.name: f.default for cls in (ClusterConfig, EngineConfig) for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
_CLUSTER_FIELDS = {f.name for f in dataclasses.fields(ClusterConfig)}
_KINDS = {bool: "a bool", int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Option:
    """One engine option: the LLM keyword `name`, its CLI flag(s) and what values it takes."""
    name: str                        # the LLM keyword; the EngineConfig / ClusterConfig field it fills, if one is
    type: type                       # bool, int, float or str (None is allowed where the default is None, or `none`)
    help: str                        # the CLI's help text
    default: object = FROM_CONFIG    # unset: the EngineConfig / ClusterConfig field's default
    flags: tuple[str, ...] = ()      # the CLI's flags; () -> (--name-with-dashes,)
    off_flag: str = ""               # a bool that is on by default: the one flag turning it off, not --name/--no-name
    metavar: str | None = None
    choices: tuple = ()
    at_least: float | None = None    # the smallest value allowed
    above: float | None = None       # every value allowed is greater
    at_most: float | None = None     # the largest value allowed
    none: str = ""                   # what None means, where None is allowed though the default is not None
    cli_none: object = None          # the command-line value that stands for None (--itl-target-ms 0)
    check: Callable[[object], str | None] | None = None   # a further check: why a value is refused, or None
    checked_by: str = ""             # where the value is checked instead (this table then checks nothing)
    on_worker: bool = False          # `burstserve worker` takes it too (settings of every host, not the head's alone)
    aliases: tuple[tuple[str, object], ...] = ()   # other names of values, as vLLM's flags take them (dtype auto)

    def __post_init__(self):
        if self.default is FROM_CONFIG:
            object.__setattr__(self, "default", _CONFIG_DEFAULTS[self.name])

    @property
    def nullable(self) -> bool:
        return self.default is None or bool(self.none)

    @property
    def cli_flags(self) -> tuple[str, ...]:
        return (self.off_flag,) if self.off_flag else self.flags or ("--" + self.name.replace("_", "-"),)

    @property
    def annotation(self):
        """The type LLM's signature shows: `type`, or `type | None`."""
        return self.type | None if self.nullable else self.type

    def canonical(self, value):
        """The value an alias stands for (dtype "auto": None, "half": "float16"); any other value as it is."""
        return dict(self.aliases).get(value, value) if isinstance(value, str) else value

    def refusal(self, value) -> str | None:
        """Why `value` cannot be this option's, or None; the message names the option by its keyword."""
        value = self.canonical(value)
        if self.checked_by or (value is None and self.nullable):
            return None
        if not _is_a(value, self.type):
            kind = _KINDS[self.type] + (" or None" if self.nullable else "")
            return f"{self.name} must be {kind}, not {value!r}"
        if self.choices and value not in self.choices:
            return f"{self.name} {value!r} is not one of {', '.join(self.choice_names())}"
        if not self._in_bounds(value):
            unset = f" (or None: {self.none})" if self.none else ""
            return f"{self.name} must be {self._bounds()}{unset}, not {value}"
        return self.check(value) if self.check else None

    def _in_bounds(self, value) -> bool:
        return ((self.at_least is None or value >= self.at_least) and (self.above is None or value > self.above)
                and (self.at_most is None or value <= self.at_most))

    def _bounds(self) -> str:
        """The allowed range in words: '>= 0', '> 0', 'in (0, 1]'."""
        low = f"[{self.at_least}" if self.at_least is not None else f"({self.above}" if self.above is not None else ""
        if low and self.at_most is not None:
            return f"in {low}, {self.at_most}]"
        if self.at_most is not None:
            return f"<= {self.at_most}"
        return f">= {self.at_least}" if self.at_least is not None else f"> {self.above}"

    def argparse_kwargs(self, checked: bool = False) -> dict:
        """add_argument's keywords for this option's flag(s): the parsed value lands in args.<name>.
        checked: a value its bounds or check refuse is refused by the parser (argparse's error, exit 2)
        rather than later by check_options; its choices are argparse's either way."""
        shown = self.type is not bool and self.default is not None and "default" not in self.help
        help_text = self.help + (" (default: %(default)s)" if shown else "")
        kwargs = dict(dest=self.name, default=self.default, help=help_text)
        if self.type is bool:
            return kwargs | dict(action="store_false" if self.off_flag else argparse.BooleanOptionalAction)
        if self.aliases:            # argparse would check the choices after the alias became its value: checked here
            names = "{" + ",".join(self.choice_names()) + "}"
            return kwargs | dict(type=self._cli_type(checked), metavar=self.metavar or names)
        kwargs |= dict(type=self._cli_type(checked), metavar=self.metavar)
        return kwargs | (dict(choices=list(self.choices)) if self.choices else {})

    def choice_names(self) -> list[str]:
        return [*map(str, self.choices), *(alias for alias, _ in self.aliases)]

    def _cli_type(self, checked: bool = False) -> Callable[[str], object]:
        """The command line's parser of a value: `type`, with `cli_none` read as None, an alias as its value
        (and, checked, the value's refusal an argparse error)."""
        if self.cli_none is None and not checked and not self.aliases:
            return self.type

        def parse(text: str):
            value = self.type(text)
            if self.aliases:
                if value not in self.choice_names():
                    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from "
                                                     f"{', '.join(self.choice_names())})")
                value = self.canonical(value)
            if self.cli_none is not None and value == self.cli_none:
                value = None
            if checked and not (self.choices and value not in self.choices):   # a choice: argparse's message
                why = self.refusal(value)
                if why:
                    raise argparse.ArgumentTypeError(why)
            return value
        parse.__name__ = self.type.__name__      # argparse names it in "invalid float value"
        return parse


def _is_a(value, kind: type) -> bool:
    """isinstance, but a bool is no number and an int is a float (as Python's own arithmetic takes them)."""
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    return isinstance(value, {int: numbers.Integral, float: numbers.Real}.get(kind, kind))


def _cluster_problem(name: str) -> Callable[[object], str | None]:
    """The check of a ClusterConfig field: ClusterConfig.problem() of that value and every other default."""
    return lambda value: ClusterConfig(**{name: value}).problem()


DEVICES_CHECK = "engine/core/devices.py resolve_devices (DeviceSpecError, naming what is there)"

OPTIONS: tuple[Option, ...] = (
    # every host names these (`serve` and `worker`): its devices, the settings the hosts must share
    # (engine/cluster.py JOIN_FIELDS) and where they meet
    Option("devices", str, "devices as torch names them: cpu, cuda (every visible GPU), cuda:1 (GPU 1), cuda:0,2 "
           "(default: every visible GPU, else cpu)", default=None, checked_by=DEVICES_CHECK, on_worker=True),
    Option("context_parallel_size", int, "worker processes that split each prompt (default: every named GPU; on "
           "CPU, 1); on CUDA the first N named GPUs, on CPU N processes on cpu", default=None,
           flags=("-cp", "--context-parallel-size"), metavar="N", checked_by=DEVICES_CHECK, on_worker=True),
    Option("dtype", str, "the weights' and activations' dtype; auto (the default): bfloat16 on GPUs, float32 on CPU; "
           "half and float as vLLM takes them", default=None, choices=tuple(DTYPES), on_worker=True,
           aliases=(("auto", None), ("half", "float16"), ("float", "float32"))),
    Option("quantization", str, "fp8: the linear layers' weights quantized to FP8 at load (per-channel scales) and "
           "their inputs per token, GEMMs on FP8 tensor cores (compute capability 8.9+); attention, norms, "
           "embeddings and the LM head stay bfloat16", flags=("--quantization", "-q"), choices=QUANTIZATIONS,
           on_worker=True),
    Option("kv_cache_dtype", str, "the paged KV cache's dtype: auto (the model's) or fp8 (= fp8_e4m3: K and V in "
           "float8_e4m3fn with a bf16 scale per token and KV head, about half the bytes, so about twice the "
           "tokens; attention sees K/V rounded so, in every call)", choices=KV_CACHE_DTYPES, on_worker=True),
    Option("kv_offload_gb", float, "GiB of host memory per worker for a tier under the prefix cache: a finished "
           "request's KV is copied there, and a prompt whose cached prefix has left the GPU gets it back from there "
           "instead of prefilling it again (pinned on GPUs, copied beside compute). Default: on GPUs a quarter of "
           "the host memory that can be pinned, shared over the local workers; on CPU 0 (none). 0: none",
           metavar="GIB", at_least=0),
    Option("sp_strategy", str, "how prefill attention spans the workers (decoding is the same for all); auto: "
           "ulysses for short prompts, burst for long ones", choices=SP_STRATEGIES, on_worker=True),
    Option("seed", int, "seed of the preset's random weights", on_worker=True),
    Option("nnodes", int, "hosts in the engine (default 1: this one)", check=_cluster_problem("nnodes"),
           on_worker=True),
    Option("master_addr", str, "the head's address, where it keeps the rendezvous (and its worker 0 the workers' "
           "group)", on_worker=True),
    Option("master_port", int, "the rendezvous port on the head; the workers' process group takes the next one",
           check=_cluster_problem("master_port"), on_worker=True),
    Option("join_timeout", float, "how long the head waits for every host to join (and a host for the head's "
           "answer)", metavar="SECONDS", check=_cluster_problem("join_timeout"), on_worker=True),
    # the head's alone (`serve`)
    Option("max_model_len", int, "the longest context, prompt and output (default: what the checkpoint is made "
           "for, its max_position_embeddings or YaRN's pretraining length x factor; presets 1,048,576)",
           at_least=1),
    Option("max_num_seqs", int, "sequences decoded together at most", at_least=1),
    Option("kv_cache_tokens", int, "KV capacity per worker in tokens (default: sized from "
           "--gpu-memory-utilization; on CPU as many as 4 GiB of K/V hold, at most 1M)", at_least=1),
    Option("gpu_memory_utilization", float, "share of each GPU's memory for weights, activations and the paged KV "
           "cache (0-1]", above=0, at_most=1),
    Option("block_size", int, "tokens per KV page (default: 128 on GPUs, 16 on CPU)", at_least=1),
    Option("cuda_graphs", bool, "decode without CUDA graphs", off_flag="--enforce-eager"),
    Option("async_scheduling", bool, "launch the next decode step before reading back the tokens of the one "
           "running, its input tokens taken on the GPU (default: on; off for a batch with a response_format); "
           "--no-async-scheduling: every step read back before the next"),
    Option("enable_prefix_caching", bool, "keep finished requests' KV in the cache (evicted least recently used "
           "first) and prefill only what a new prompt adds to the longest cached prefix (default: on; "
           "--no-enable-prefix-caching: every prompt prefilled whole)"),
    Option("enable_chunked_prefill", bool, "prefill a prompt longer than --max-num-batched-tokens in chunks, and a "
           "shorter one too when in one call it would hold the running requests past --itl-target-ms; the "
           "running requests decode between chunks and short new prompts go before the next chunk (default: on; "
           "--no-enable-chunked-prefill: every prompt in one prefill, the others wait for it)", default=True),
    Option("max_num_batched_tokens", int, "the largest chunk of chunked prefill (default "
           f"{DEFAULT_CHUNK_TOKENS_PER_WORKER} per worker a prompt is sharded over, up to "
           f"{DEFAULT_CHUNK_WORKERS_MAX}: {default_chunk_tokens(2)} on 2 workers or more, "
           f"{DEFAULT_CHUNK_TOKENS_PER_WORKER} on one or under tp)", metavar="N", at_least=1),
    Option("itl_target_ms", float, "with chunked prefill: while other requests decode, each chunk is sized so that "
           "it and one decode step take about MS milliseconds, from a cost model fitted to the engine's own "
           "prefill times; alone, chunks are N tokens. 0: chunks of N tokens always", metavar="MS", above=0,
           none="no target", cli_none=0),
    Option("mixed_batch", bool, "with chunked prefill: a chunk after a prompt's first and the running requests' "
           "decode step run as one forward pass (the weights read once for both). Default: on where the workers "
           "replay that pass as CUDA graphs (CUDA with flash-attn-4, chunks up to 1024 tokens graphed), else a "
           "chunk, then a decode step; --no-mixed-batch: never"),
    Option("extend_ring_min_tokens", int, "on several workers, a prompt chunk or the part of a prompt after its "
           "cached prefix of at least N tokens is sharded over the workers (K/V ring, queries passed to the "
           "cache); fewer run whole on every worker, one worker keeping their K/V (one collective a layer). "
           "0: always sharded", metavar="N", at_least=0),
    Option("extend_pass", str, "on several workers, how a sharded extend (a prompt chunk, or a prompt past its cached "
           "prefix, of at least --extend-ring-min-tokens) sees the cached tokens: kv: each worker's cached K/V goes "
           "around the ring with the new K/V, attended while the next block travels (bf16 pages, where the blocks fit "
           "the memory reserved for a chunk's pass-Q; else q); q: every worker's new queries gathered to each "
           "worker's cache and their partials sent back (one all-gather and one all-to-all a layer)",
           choices=("kv", "q")),
    Option("auto_ulysses_max_tokens", int, "--sp-strategy auto: the longest prompt that uses ulysses", at_least=0),
    Option("zero_sliced_max_tokens", int, "--sp-strategy burst-zero: prompts of at most N tokens run on the weight "
           "slices as they lie (tensor parallel, no layer gathered; K/V kept in burst's layout). Default: measured "
           "at start on GPUs (a layer's gather against a row's GEMMs and all-reduces), none on CPU; at most a "
           "worker's share of --max-model-len. 0: never. Other strategies: unused", metavar="N", at_least=0),
    Option("attention_backend", str, "the local attention kernel: auto (flash-attn-4 on SM90+ when installed, then "
           "cuDNN, PyTorch's FA2; on CPU PyTorch's CPU flash kernel, then the reference) or one by name. "
           "fa3-fp8: FP8 attention for prefill (opt-in; FlashAttention-3's FP8 forward on Hopper, package fa3-fwd; "
           "the same arithmetic in torch on CPU): prompts, ring blocks and chunks; decode and small extends "
           "keep their kernels",
           default="auto", choices=tuple(ATTENTION_BACKENDS)),
    Option("overlap", bool, "exchange K/V blocks without overlapping compute", off_flag="--no-overlap"),
)
BY_NAME = {o.name: o for o in OPTIONS}


def _chunk_without_chunking(values: Mapping) -> tuple[str, str] | None:
    if not values["enable_chunked_prefill"] and values["max_num_batched_tokens"] is not None:
        return ("max_num_batched_tokens sets the chunk of chunked prefill, which enable_chunked_prefill=False turns "
                "off: give one or the other", "max_num_batched_tokens")
    return None


def _strategy_options(values: Mapping) -> tuple[str, str] | None:
    return STRATEGIES[values["sp_strategy"]].option_refusal(values)


# Checks of several options at once, after each option's own: (values) -> (why, the option to name) or None
CROSS_CHECKS: tuple[Callable[[Mapping], tuple[str, str] | None], ...] = (_chunk_without_chunking, _strategy_options)


def check_options(given: Mapping[str, object]) -> dict:
    """Every option's value (the given ones, the rest their defaults), checked: a TypeError names an
    unknown keyword, as Python's own calls do; an InvalidRequestError names the option refused."""
    unknown = sorted(set(given) - set(BY_NAME))
    if unknown:
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
    values = {o.name: o.canonical(given.get(o.name, o.default)) for o in OPTIONS}
    for o in OPTIONS:
        why = o.refusal(values[o.name])
        if why:
            raise InvalidRequestError(why, o.name)
    for check in CROSS_CHECKS:
        refused = check(values)
        if refused:
            raise InvalidRequestError(*refused)
    return values


def add_arguments(parser, options: Iterable[Option], checked: bool = False) -> None:
    """The options' flags on an argparse parser; each value lands in args.<the option's name>. checked:
    values their bounds or checks refuse are refused at parse (Option.argparse_kwargs)."""
    for o in options:
        parser.add_argument(*o.cli_flags, **o.argparse_kwargs(checked))


def from_args(args: argparse.Namespace, options: Iterable[Option] = OPTIONS) -> dict:
    """The option values a parsed command line holds (those its parser took), by LLM keyword; `options`:
    only these (a command whose own flags share an option's name, as bench's --seed, names the ones it took)."""
    return {o.name: getattr(args, o.name) for o in options if hasattr(args, o.name)}


def chunk_tokens(values: Mapping, world_size: int) -> int | None:
    """EngineConfig.max_num_batched_tokens on world_size workers: the chunk of chunked prefill, None when it is
    off; by default engine.config.default_chunk_tokens of the workers the strategy shards a prompt over."""
    if not values["enable_chunked_prefill"]:
        return None
    if values["max_num_batched_tokens"]:
        return values["max_num_batched_tokens"]
    strategy = STRATEGIES[values["sp_strategy"]]
    return default_chunk_tokens(strategy(min(world_size, strategy.max_workers or world_size)).kv_workers)


def engine_config(model: str, devices: list[str], values: Mapping) -> EngineConfig:
    """The EngineConfig of checked option values (check_options) on these devices: every option named
    like a field fills it; the devices, dtype's default (by device), the kernel and the chunk are resolved here."""
    fields = {name: value for name, value in values.items() if name in _ENGINE_FIELDS}
    fields.update(model=model, devices=devices, dtype=values["dtype"] or default_dtype(devices),
                  kernel=ATTENTION_BACKENDS[values["attention_backend"]],
                  max_num_batched_tokens=chunk_tokens(values, len(devices)))
    return EngineConfig(**fields)


def cluster_config(values: Mapping, node_rank: int = 0) -> ClusterConfig:
    """The ClusterConfig of option values, this host being node_rank (0: the head)."""
    return ClusterConfig(node_rank=node_rank, **{k: v for k, v in values.items() if k in _CLUSTER_FIELDS})


def with_options(init: Callable) -> Callable:
    """`init(self, ..., **options)` showing every option as a keyword-only parameter with its default
    (help(), inspect.signature, editors), as if each were written out."""
    signature = inspect.signature(init)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.annotation)
               for o in OPTIONS]
    init.__signature__ = signature.replace(parameters=params)
    return init


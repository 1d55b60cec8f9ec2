"""The engine options an offline run (`burstserve bench ... --offline`) gives LLM, each a row of
engine/options.py's table: the flags, values and defaults of `burstserve serve`, so that one configuration's
flags work in both (over HTTP --serve's arguments carry them; --devices and -cp are added to those). The
other LLM arguments are the bench's own: --model, max_model_len (the longest request) and max_num_seqs (from
--batch)."""
from burstserve.engine.options import BY_NAME, from_args

OFFLINE_OPTIONS = ("devices", "context_parallel_size", "dtype", "quantization", "kv_cache_dtype", "sp_strategy",
                   "attention_backend", "overlap", "async_scheduling", "enable_chunked_prefill",
                   "max_num_batched_tokens", "extend_pass", "zero_sliced_max_tokens", "kv_cache_tokens",
                   "kv_offload_gb")


def offline_options(args) -> dict:
    """The engine options of an offline run, by LLM keyword, as its command line gave them (from_args of
    OFFLINE_OPTIONS alone: shared's --seed, of the random prompts, is no engine seed)."""
    return from_args(args, [BY_NAME[name] for name in OFFLINE_OPTIONS])

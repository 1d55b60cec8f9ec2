"""Weights: safetensors from a local directory (single file or sharded index), or random for presets.

Tensors are read straight onto the worker's device (safetensors' `device=`), one at a time, so no
worker holds a full CPU copy of the model. With `slices` (tensor parallelism: name -> (dim, start,
stop)) a worker reads only its part of each sliced tensor (safetensors' `get_slice`), so no process
ever holds a sharded weight whole.
"""
import json
import os

import torch

from burstserve.engine.core.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def weight_files(model_dir: str) -> dict[str, str]:
    """Maps each tensor name to the safetensors file holding it; raises ModelLoadError when absent."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        missing = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(model_dir, v))})
        if missing:
            raise ModelLoadError(f"{index} names weight files that are missing: {', '.join(missing)}")
        return {name: os.path.join(model_dir, fname) for name, fname in weight_map.items()}
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        from safetensors import safe_open
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ModelLoadError(f"model directory {model_dir!r} has no weights: expected {SINGLE_FILE} or {INDEX_FILE}")


def load_weights(model_dir: str, names: list[str], device: torch.device, dtype: torch.dtype,
                 slices: dict[str, tuple[int, int, int]] | None = None) -> dict[str, torch.Tensor]:
    """Reads the named tensors onto `device` in `dtype` (a sliced one: its part only); raises
    ModelLoadError naming a missing tensor."""
    from safetensors import safe_open
    files = weight_files(model_dir)
    stored = {n: stored_name(n, files) for n in names}
    missing = [n for n in names if stored[n] is None]
    if missing:
        raise ModelLoadError(f"weights in {model_dir!r} lack tensor {missing[0]!r} ({len(missing)} missing)")
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(files[stored[n]], []).append(n)
    out = {}
    load_device = "cpu" if device.type == "cpu" else str(device)
    for path, file_names in by_file.items():
        with safe_open(path, framework="pt", device=load_device) as f:
            for n in file_names:
                part = _read_slice(f, stored[n], slices[n]) if slices and n in slices else f.get_tensor(stored[n])
                out[n] = part.to(dtype)
    return out


# A vision-language checkpoint keeps its language model's tensors under this prefix (Gemma 3's 4B, 12B and 27B
# releases, as transformers saves Gemma3ForConditionalGeneration): the engine reads the text model alone.
LANGUAGE_MODEL_PREFIX = "language_model."


def stored_name(name: str, files: dict[str, str]) -> str | None:
    """The name a checkpoint stores the text model's tensor `name` under, or None: absent."""
    if name in files:
        return name
    prefixed = LANGUAGE_MODEL_PREFIX + name
    return prefixed if prefixed in files else None


def _read_slice(f, name: str, part: tuple[int, int, int]) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) start:stop of a tensor, read without reading the rest."""
    dim, start, stop = part
    view = f.get_slice(name)
    return view[start:stop] if dim == 0 else view[:, start:stop]


def take_slice(t: torch.Tensor, part: tuple[int, int, int]) -> torch.Tensor:
    """The same part of an in-memory tensor, as its own (contiguous) tensor."""
    dim, start, stop = part
    return t.narrow(dim, start, stop - start).contiguous()


def weight_bytes(names_shapes: dict[str, tuple[int, ...]], itemsize: int,
                 slices: dict[str, tuple[int, int, int]] | None = None) -> int:
    """Bytes of the weights one worker holds (a sliced tensor: its part)."""
    total = 0
    for name, shape in names_shapes.items():
        numel = 1
        for i, n in enumerate(shape):
            part = (slices or {}).get(name)
            numel *= (part[2] - part[1]) if part is not None and part[0] == i else n
        total += numel * itemsize
    return total


def random_weights(names_shapes: dict[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype,
                   seed: int, slices: dict[str, tuple[int, int, int]] | None = None) -> dict[str, torch.Tensor]:
    """Same seed, same weights on every worker: N(0, 0.02) for matrices, ones for norm scales. A sliced
    tensor is drawn whole (the same values whatever the layout), its part kept, the rest freed at once."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in names_shapes.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            out[name] = (torch.randn(shape, device=device, dtype=torch.float32 if dtype == torch.float32 else dtype,
                                     generator=gen) * 0.02).to(dtype)
        if slices and name in slices:
            out[name] = take_slice(out[name], slices[name])
    return out

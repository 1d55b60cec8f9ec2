"""Which device each worker runs on, from `devices` (named as torch names them) and the context parallel size.

`devices` names devices: `cpu` (or `cpu:0`), `cuda` (every visible GPU), `cuda:1` (GPU 1), `cuda:0,2`
(GPUs 0 and 2). The context parallel size is how many worker processes split a prompt: by default
every named GPU, or 1 on CPU. On CUDA a smaller size takes the first N named GPUs; on CPU every worker
is a process on "cpu" (gloo). Whatever the machine cannot satisfy is a DeviceSpecError naming what is
there and what to type instead.
"""
import torch

from burstserve.engine.core.errors import DeviceSpecError

FORMS = "cpu, cuda, cuda:1 or cuda:0,2"
CP_FLAG = "--context-parallel-size"


def resolve_devices(devices: str | None = None, context_parallel_size: int | None = None) -> list[str]:
    """One torch device string per worker process, e.g. ['cuda:0', 'cuda:2'] or ['cpu', 'cpu']."""
    spec = _normalize(devices) if devices is not None and devices.strip() else default_devices()
    named = parse_devices(spec)
    size = check_context_parallel_size(context_parallel_size)
    if named == ["cpu"]:
        return ["cpu"] * (size or 1)
    if size is None:
        return named
    if size > len(named):
        raise DeviceSpecError(_too_few_message(spec, named, size))
    return named[:size]


def _too_few_message(spec: str, named: list[str], size: int) -> str:
    visible = visible_gpus()
    more = f", or name more of the visible GPUs ({', '.join(visible)})" if len(visible) > len(named) else ""
    return (f"context parallel size {size} needs {size} devices, but --devices {spec} names {len(named)} "
            f"({', '.join(named)}); use {CP_FLAG} {len(named)} or less{more}")


def parse_devices(spec: str) -> list[str]:
    """The devices `spec` names, each once: 'cpu' -> ['cpu'], 'cuda:0,2' -> ['cuda:0', 'cuda:2']."""
    spec = _normalize(spec)
    kind, colon, rest = spec.partition(":")
    if kind == "cpu":
        return _parse_cpu(spec, rest) if colon else ["cpu"]
    if kind != "cuda" or (colon and not rest):
        raise DeviceSpecError(f"--devices {spec or repr(spec)} is not a device: use {FORMS} "
                              f"(and {CP_FLAG} N for the number of workers)")
    visible = visible_gpus()
    if not visible:
        raise DeviceSpecError(f"--devices {spec}: no CUDA GPU is visible; use --devices cpu")
    if not colon:
        return visible
    indices = _parse_indices(spec, rest)
    return [_check_visible(spec, index, visible, len(indices) == 1) for index in indices]


def check_context_parallel_size(size: int | None) -> int | None:
    """`size` itself (None: the default), or a DeviceSpecError when it is not a whole number >= 1."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int):
        raise DeviceSpecError(f"context parallel size {size!r} is not a whole number; use {CP_FLAG} N with N >= 1")
    if size < 1:
        raise DeviceSpecError(f"context parallel size {size} is less than 1; use {CP_FLAG} N with N >= 1 "
                              "(the number of worker processes)")
    return size


def default_devices() -> str:
    """Every visible GPU, else the CPU."""
    return "cuda" if visible_gpus() else "cpu"


def visible_gpus() -> list[str]:
    """['cuda:0', 'cuda:1', ...]: the GPUs this process sees (CUDA_VISIBLE_DEVICES applied)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(count)]


def _normalize(spec: str | None) -> str:
    return "".join((spec or "").split()).lower()


def _parse_cpu(spec: str, rest: str) -> list[str]:
    """'cpu:0' is torch's name for the CPU; 'cpu:N' was the old worker count."""
    if rest == "0":
        return ["cpu"]
    if rest.isdigit():
        raise DeviceSpecError(f"--devices {spec} is not a worker count any more: "
                              f"use --devices cpu {CP_FLAG} {int(rest)}")
    raise DeviceSpecError(f"--devices {spec} is not a device: use --devices cpu (torch's cpu:0 is the same device)")


def _parse_indices(spec: str, rest: str) -> list[int]:
    indices = []
    for part in rest.split(","):
        if not part.isdigit():
            raise DeviceSpecError(f"--devices {spec}: {part!r} is not a GPU index; use {FORMS}")
        if int(part) in indices:
            raise DeviceSpecError(f"--devices {spec} names GPU {int(part)} twice; name each GPU once")
        indices.append(int(part))
    return indices


def _check_visible(spec: str, index: int, visible: list[str], alone: bool) -> str:
    """'cuda:INDEX' if that GPU is visible; a lone index may be the old GPU count (cuda:4 was 4 GPUs)."""
    if index < len(visible):
        return f"cuda:{index}"
    are = "GPU is" if len(visible) == 1 else "GPUs are"
    old_count = alone and index == len(visible)
    hint = f"; for {index} workers on the first GPUs use --devices cuda {CP_FLAG} {index}" if old_count else ""
    raise DeviceSpecError(f"--devices {spec} names GPU {index}, but {len(visible)} {are} visible "
                          f"({', '.join(visible)}){hint}")


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on CPU): before and after a timed region."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without making the host wait for the work already queued there: through
    pinned memory and an asynchronous copy (PyTorch's pinned-memory cache keeps the block until the copy has
    run). A plain copy from pageable memory waits for the stream, which would stall the host behind a
    decode step in flight (asynchronous scheduling). On CPU, the tensor itself."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)

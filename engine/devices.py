"""Parse a `devices` string (cpu, cpu:N, cuda, cuda:N, cuda:0,2,...) into one device per worker."""
import torch

from engine.errors import DeviceSpecError

_FORMS = "cpu, cpu:N, cuda, cuda:N, or cuda:I,J,... (e.g. cuda:0,1)"


def parse_devices(spec: str) -> list[str]:
    """Returns one torch device string per worker process, e.g. ['cuda:0', 'cuda:1']."""
    spec = (spec or "").strip().lower()
    kind, _, rest = spec.partition(":")
    if kind == "cpu":
        count = _parse_count(rest, spec) if rest else 1
        return ["cpu"] * count
    if kind != "cuda":
        raise DeviceSpecError(f"devices {spec!r} is not one of {_FORMS}")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise DeviceSpecError(f"devices {spec!r} asks for CUDA, but no CUDA GPU is visible; use devices='cpu' or 'cpu:N'")
    if not rest:
        return [f"cuda:{i}" for i in range(visible)]
    if "," in rest:
        indices = [_parse_index(part, spec) for part in rest.split(",")]
        if len(set(indices)) != len(indices):
            raise DeviceSpecError(f"devices {spec!r} names a GPU twice")
        missing = [i for i in indices if i >= visible]
        if missing:
            raise DeviceSpecError(f"devices {spec!r} names GPU {missing[0]}, but only {visible} GPU(s) are visible")
        return [f"cuda:{i}" for i in indices]
    count = _parse_count(rest, spec)
    if count > visible:
        raise DeviceSpecError(f"devices {spec!r} asks for {count} GPUs, but only {visible} are visible")
    return [f"cuda:{i}" for i in range(count)]


def default_devices() -> str:
    """Every visible GPU, else one CPU worker."""
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"


def _parse_count(text: str, spec: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise DeviceSpecError(f"devices {spec!r}: {text!r} is not a positive worker count; expected {_FORMS}")
    return int(text)


def _parse_index(text: str, spec: str) -> int:
    text = text.strip()
    if not text.isdigit():
        raise DeviceSpecError(f"devices {spec!r}: {text!r} is not a GPU index; expected {_FORMS}")
    return int(text)


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on CPU): before and after a timed region."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

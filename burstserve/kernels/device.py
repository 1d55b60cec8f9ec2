"""Facts about a device that several kernels ask (a leaf: it imports no other kernels module)."""
import functools

import torch


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """The CUDA device's streaming multiprocessor count."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def below_fp8_capability(gpus: list[str], what: str) -> str | None:
    """`what`, naming the first of these CUDA devices below compute capability 8.9 (FP8), or None."""
    for d in gpus:
        major, minor = torch.cuda.get_device_capability(torch.device(d))
        if (major, minor) < (8, 9):
            return (f"{what} (compute capability 8.9 or newer); {d} is "
                    f"{torch.cuda.get_device_name(torch.device(d))}, capability {major}.{minor}")
    return None

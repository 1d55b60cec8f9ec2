"""How much host memory the KV host tier may pin (--kv-offload-gb), checked before any worker starts.

What this host can pin: the kernel's MemAvailable, or less where a cgroup (a container's memory limit)
leaves less (pinned pages count against it, and passing its limit is an OOM kill, not a refusal), less
HOST_RESERVE kept free for the workers' own memory (the model on CPU, the CUDA context, torch).
Unset on GPUs, each local worker gets AUTO_SHARE of that, shared out; on CPU the tier is off.
"""
import os

from burstserve.engine.core.errors import DeviceSpecError

HOST_RESERVE = 8 << 30     # bytes kept free beside the tier
AUTO_SHARE = 0.25          # unset --kv-offload-gb on GPUs: this share of what can be pinned, over the local workers


def _meminfo_available(path: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None     # "max": no limit


def _cgroup_room(cgroup_dir: str) -> int | None:
    """What the cgroup's memory limit leaves (v2: memory.max - memory.current; v1: limit - usage), or None."""
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        cap, used = _read_int(os.path.join(cgroup_dir, limit)), _read_int(os.path.join(cgroup_dir, usage))
        if cap is not None and used is not None and cap < 1 << 60:    # v1 writes "no limit" as a huge number
            return max(0, cap - used)
    return None


def pinnable(meminfo: str = "/proc/meminfo", cgroup_dir: str = "/sys/fs/cgroup") -> tuple[int, str]:
    """(bytes this host can pin for the tier, how that was found: the figures, for a refusal or the log)."""
    available, room = _meminfo_available(meminfo), _cgroup_room(cgroup_dir)
    known = [x for x in (available, room) if x is not None]
    can = max(0, min(known) - HOST_RESERVE) if known else 0
    how = (f"MemAvailable {_gib(available)}, cgroup limit "
           f"{'none' if room is None else _gib(room) + ' left'}, {_gib(HOST_RESERVE)} kept free")
    return can, how


def offload_gib(asked: float | None, devices: list[str], local_workers: int, meminfo: str = "/proc/meminfo",
                cgroup_dir: str = "/sys/fs/cgroup") -> float:
    """--kv-offload-gb per worker, resolved and checked: unset -> 0 on CPU, on GPUs AUTO_SHARE of what can be
    pinned over the local workers; a size the host cannot pin is refused (DeviceSpecError) with the figures."""
    if asked == 0 or (asked is None and not any(d.startswith("cuda") for d in devices)):
        return 0.0
    can, how = pinnable(meminfo, cgroup_dir)
    if asked is None:
        return round(AUTO_SHARE * can / local_workers / 2**30, 1)
    want = asked * local_workers * 2**30
    if want > can:
        raise DeviceSpecError(f"--kv-offload-gb {asked:g} on {local_workers} worker(s) asks {_gib(want)} of host "
                              f"memory for the KV host tier; this host can give at most {_gib(can)} ({how}): "
                              f"lower --kv-offload-gb")
    return float(asked)


def _gib(n: int | float | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.1f} GiB"

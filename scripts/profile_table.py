"""The GPU kernels of a torch.profiler run as a markdown table, for the scripts/gpu_*_profile.py scripts."""


def kernel_table(prof, repeats: int = 1, top: int = 15) -> tuple[float, int, str]:
    """prof: a finished torch.profiler.profile over `repeats` identical steps -> (GPU busy ms per step,
    kernels per step, a table of the `top` kernels by GPU time: name, calls per step, ms per step)."""
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    groups: dict[str, list] = {}
    for e in events:
        g = groups.setdefault(e.name[:80], [0, 0.0])
        g[0] += 1
        g[1] += e.device_time / 1e3 / repeats
    rows = ["| kernel | calls | ms |", "|---|---|---|"]
    rows += [f"| {name} | {calls // repeats} | {ms:.3f} |"
             for name, (calls, ms) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]]
    busy = sum(e.device_time for e in events) / 1e3 / repeats
    return busy, len(events) // repeats, "\n".join(rows)

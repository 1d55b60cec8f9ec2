"""Summary statistics in milliseconds, named as `vllm bench serve` names them."""
import statistics


def summarize(name: str, seconds: list[float]) -> dict:
    """{mean_NAME_ms, median_NAME_ms, std_NAME_ms, p99_NAME_ms} of a list of seconds (zeros when empty)."""
    ms = sorted(s * 1e3 for s in seconds)
    if not ms:
        return {f"{k}_{name}_ms": 0.0 for k in ("mean", "median", "std", "p99")}
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
            f"std_{name}_ms": statistics.pstdev(ms), f"p99_{name}_ms": percentile(ms, 99)}


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)

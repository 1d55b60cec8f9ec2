"""Summary statistics in milliseconds, named as `vllm bench serve` names them, and the per-request clock
readings the sweep computes them from (TTFT, TPOT, generated tokens/s)."""
import statistics
from dataclasses import dataclass


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


@dataclass
class RequestTiming:
    """One request's clock readings, in seconds on one clock (perf_counter over HTTP, time.time offline)."""
    sent: float                   # when the request was sent (offline: submitted to the engine)
    token_times: list[float]      # when each generated token reached the client, in order: one per token
    server_prefill: float = 0.0   # the server's own prefill time for this request

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def tpot(self) -> float | None:
        """Time per output token: (end-to-end latency - TTFT) / (tokens - 1); None for a single token."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def batch_throughput(batch: list[RequestTiming]) -> tuple[float, float | None]:
    """Generated tokens per second of requests sent together -> (output, decode).

    output: every generated token / (the last token of any request - the first send): what the batch
        delivered, prefills included.
    decode: the tokens generated after the last request's first token / (the last token of any request -
        that first token): the window in which every request of the batch is past its prefill. Tokens that
        early requests decoded while later prompts were still prefilling fall outside the window and are not
        counted. None when no token comes after that first token (one output token each)."""
    start = min(r.sent for r in batch)
    last_first = max(r.token_times[0] for r in batch)
    end = max(r.token_times[-1] for r in batch)
    total = sum(len(r.token_times) for r in batch)
    in_window = sum(1 for r in batch for t in r.token_times if t > last_first)
    return total / (end - start), (in_window / (end - last_first) if in_window else None)

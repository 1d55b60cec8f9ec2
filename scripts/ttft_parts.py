"""Where HTTP TTFT goes, per prompt length: the server's request lines (`--log-level info`, see
server/timeline.py) of a `bench sweep --serve` run, paired in order with the sweep's client-side TTFTs.

    python scripts/ttft_parts.py OUT/sweep-http/stderr.log OUT/sweep-http/results.json

Prints a markdown table of means (ms): client TTFT, the server's TTFT (headers in -> first token on its
event loop) and its parts, "wire" = client TTFT - the server's (sending, the SSE write, the read), and
"HTTP - engine" = client TTFT - the engine's part (what offline TTFT measures) of the same request.
"""
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from burstserve.server.timeline import PARTS_PATTERN  # noqa: E402

PROMPT = re.compile(r"(\d+) prompt tokens, ")
PARTS = ["ttft", "read", "checks", "engine", "queued", "prefill", "between", "back"]


def server_lines(log_path: str) -> dict[int, list[dict]]:
    """prompt tokens -> the server's parts of each request, in the order they finished (ms)."""
    out: dict[int, list[dict]] = {}
    for line in open(log_path, errors="replace"):
        parts, prompt = PARTS_PATTERN.search(line), PROMPT.search(line)
        if parts and prompt:
            out.setdefault(int(prompt.group(1)), []).append({k: float(parts.group(k) or 0) for k in PARTS})
    return out


def main(log_path: str, results_path: str) -> None:
    rows = json.load(open(results_path))["rows"]
    lines = server_lines(log_path)
    print("| prompt tokens | requests | client TTFT | server TTFT | read | checks | engine | of which queued | "
          "of which prefill | of which between | back | wire (client - server) | HTTP - engine | its median |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        n = row["prompt_tokens"]
        client = row["warmup_ttft_ms_samples"] + row["ttft_ms_samples"]
        server = lines.get(n, [])
        if len(server) != len(client):
            print(f"| {n} | {len(client)} client, {len(server)} server lines: cannot pair |")
            continue
        warm = len(row["warmup_ttft_ms_samples"])
        client, server = client[warm:], server[warm:]
        mean = {k: statistics.fmean(s[k] for s in server) for k in PARTS}
        wire = statistics.fmean(c - s["ttft"] for c, s in zip(client, server))
        overs = [c - s["engine"] for c, s in zip(client, server)]
        print(f"| {n} | {len(client)} | {statistics.fmean(client):.1f} | {mean['ttft']:.1f} | {mean['read']:.1f} | "
              f"{mean['checks']:.1f} | {mean['engine']:.1f} | {mean['queued']:.1f} | {mean['prefill']:.1f} | "
              f"{mean['between']:.1f} | {mean['back']:.1f} | {wire:.1f} | {statistics.fmean(overs):.1f} | {statistics.median(overs):.1f} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""Writes a benchmark's results: results.json, results.csv, results.md (the paper's table shape) and
ttft.png (TTFT vs prompt length, log-log, one line per configuration); merges several runs."""
import csv
import json
import os

SWEEP_COLUMNS = ["label", "strategy", "devices", "num_devices", "prompt_tokens", "repeats", "mean_ttft_ms",
                 "std_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_server_prefill_ms", "error"]


def write_sweep(output_dir: str, rows: list[dict], meta: dict) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump({"mode": "sweep", **meta, "rows": rows}, f, indent=1)
    with open(os.path.join(output_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, SWEEP_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(output_dir, "results.md"), "w") as f:
        f.write(sweep_table(rows, meta))
    plot_sweep(rows, os.path.join(output_dir, "ttft.png"))


def sweep_table(rows: list[dict], meta: dict) -> str:
    """Rows: prompt lengths; columns: configurations; cells: mean TTFT in seconds (std), or OOM."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    lengths = sorted({r["prompt_tokens"] for r in rows})
    cell = {(r["label"], r["prompt_tokens"]): r for r in rows}
    lines = [f"Time to first token, seconds: mean (std) over repeats. {meta.get('note', '')}".strip(), "",
             "| prompt tokens | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for n in lengths:
        cells = [_cell(cell.get((label, n))) for label in labels]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("error"):
        return "OOM" if "OutOfMemory" in row["error"] or "out of memory" in row["error"] else "error"
    return f"{row['mean_ttft_ms'] / 1e3:.3f} ({row['std_ttft_ms'] / 1e3:.3f})"


def plot_sweep(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r["label"] for r in rows):
        points = sorted((r["prompt_tokens"], r["mean_ttft_ms"] / 1e3) for r in rows
                        if r["label"] == label and not r.get("error"))
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_load(output_dir: str, result: dict) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump({"mode": "load", **result}, f, indent=1)
    scalars = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
    with open(os.path.join(output_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, list(scalars))
        writer.writeheader()
        writer.writerow(scalars)
    with open(os.path.join(output_dir, "results.md"), "w") as f:
        f.write("| metric | value |\n|---|---|\n" + "".join(
            f"| {k} | {v:.3f} |\n" if isinstance(v, float) else f"| {k} | {v} |\n" for k, v in scalars.items()))


def merge(paths: list[str], output_dir: str) -> list[dict]:
    """Several sweeps' results.json into one table and plot."""
    rows, notes = [], []
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        if data.get("mode") != "sweep":
            raise ValueError(f"{p} is not a sweep's results.json")
        rows += data["rows"]
        notes.append(data.get("note", ""))
    write_sweep(output_dir, rows, {"note": " ".join(n for n in notes if n), "merged_from": paths})
    return rows

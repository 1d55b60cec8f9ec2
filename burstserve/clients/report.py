"""Writes a benchmark's results: results.json, results.csv, results.md (the paper's table shape) and
ttft.png (TTFT vs prompt length, log-log, one line per configuration); for rows that decoded (output_len > 1)
also the decode table (TPOT, generated tokens/s) and tpot.png; merges several runs. Rows written before
--output-len (no output_len, no TPOT) are TTFT-only rows."""
import csv
import json
import os
import re
import shutil
import subprocess

SWEEP_COLUMNS = ["label", "strategy", "devices", "num_devices", "context_parallel_size", "kernel", "prompt_tokens",
                 "batch", "output_len", "repeats", "mean_ttft_ms", "std_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                 "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_output_tokens_per_s",
                 "mean_decode_tokens_per_s", "decode_mode", "mean_server_prefill_ms",
                 "mean_exchange_ms", "mean_exposed_ms", "hidden_fraction", "peak_memory_gib", "mean_setup_ms",
                 "mean_wrapup_ms", "mean_call_ms", "error"]
NOT_RUN = "-: not run (a shorter prompt of that configuration had already failed)"


def write_result_files(output_dir: str, data: dict, columns: list[str], csv_rows, table: str) -> None:
    """Every mode's three files: results.json (data), results.csv (csv_rows, the given columns; other keys
    left out) and results.md (table)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(output_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(csv_rows)
    with open(os.path.join(output_dir, "results.md"), "w") as f:
        f.write(table)


def write_sweep(output_dir: str, rows: list[dict], meta: dict) -> None:
    write_result_files(output_dir, {"mode": "sweep", **meta, "rows": rows}, SWEEP_COLUMNS, rows,
                       sweep_table(rows, meta) + failures(rows) + decode_table(rows))
    plot_sweep(rows, os.path.join(output_dir, "ttft.png"))
    if decoded(rows):
        plot_tpot(rows, os.path.join(output_dir, "tpot.png"))


def sweep_table(rows: list[dict], meta: dict) -> str:
    """Rows: prompt lengths; columns: configurations; cells: mean TTFT in seconds (std), or OOM."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    lengths = sorted({r["prompt_tokens"] for r in rows})
    cell = {(r["label"], r["prompt_tokens"]): r for r in rows}
    lines = [f"Time to first token, seconds: mean (std) over the measured requests. {meta.get('note', '')}".strip(), "",
             "| prompt tokens | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for n in lengths:
        cells = [_cell(cell.get((label, n))) for label in labels]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("error"):
        return failure(row)
    return f"{row['mean_ttft_ms'] / 1e3:.3f} ({row['std_ttft_ms'] / 1e3:.3f})"


def decoded(rows: list[dict]) -> list[dict]:
    """The rows whose requests generated more than one token (rows written before --output-len did not)."""
    return [r for r in rows if r.get("output_len", 1) > 1]


DECODE_NOTE = ("Decode: time per output token (TPOT = (end-to-end - TTFT) / (tokens - 1)) in ms, mean / p50 / p99 "
               "over every measured request; generated tokens/s of each batch, mean over its repeats: all its "
               "tokens / (last token - first send), and decode: tokens after the batch's last first token / "
               "(last token - that first token).")


def decode_table(rows: list[dict]) -> str:
    """One line per configuration and length that decoded: TTFT, TPOT, generated tokens/s; '' when none did."""
    rows = decoded(rows)
    if not rows:
        return ""
    lines = ["", DECODE_NOTE, "", "| configuration | prompt tokens | batch | output tokens | TTFT s | TPOT ms | "
             "TPOT p50 | TPOT p99 | generated tok/s | decode tok/s | decode mode |", "|---|" + "---|" * 10]
    for r in rows:
        head = f"| {r['label']} | {r['prompt_tokens']} | {r.get('batch', 1)} | {r['output_len']} | "
        if r.get("error"):
            lines.append(head + failure(r) + " |" + " |" * 6)
            continue
        lines.append(head + f"{r['mean_ttft_ms'] / 1e3:.3f} | {r['mean_tpot_ms']:.2f} | {r['median_tpot_ms']:.2f} | "
                     f"{r['p99_tpot_ms']:.2f} | {r['mean_output_tokens_per_s']:.1f} | "
                     f"{r['mean_decode_tokens_per_s']:.1f} | {r.get('decode_mode', '')} |")
    return "\n".join(lines) + "\n"


UNFINISHED = "unfinished: the run stopped while measuring this length (killed at its time limit?)"


def unfinished_row(args, n: int, previous: dict | None) -> dict:
    """The row written for the length being measured, replaced once it is measured."""
    kept = ("label", "strategy", "devices", "num_devices", "context_parallel_size", "kernel")
    fields = {k: previous[k] for k in kept if k in previous} if previous else \
        {"label": args.label or "?", "strategy": args.sp_strategy, "num_devices": 0, "context_parallel_size": 0}
    return {**fields, "prompt_tokens": n, "batch": getattr(args, "batch", 1),
            "output_len": getattr(args, "output_len", 1), "repeats": 0, "error": UNFINISHED, "ttft_ms_samples": [],
            "warmup_ttft_ms_samples": [], "mean_ttft_ms": 0.0, "std_ttft_ms": 0.0, "mean_server_prefill_ms": 0.0}


def failures(rows: list[dict]) -> str:
    """Under the table: why each failed cell failed (its error's first line), '' when none did."""
    lines = [f"- `{r['label']}` at {r['prompt_tokens']} tokens, {failure(r)}: "
             f"{(r['error'].strip().splitlines() or [''])[0][:300]}" for r in rows if r.get("error")]
    return "\nFailed:\n" + "\n".join(lines) + "\n" if lines else ""


def plot_label(label: str, rows: list[dict]) -> str:
    """A configuration's legend entry: its label, and the lengths where it failed (the plot has no point there)."""
    failed = [f"{failure(r)} at {r['prompt_tokens']}" for r in rows if r["label"] == label and r.get("error")]
    return f"{label} ({', '.join(failed)})" if failed else label


def failure(row: dict) -> str:
    """A failed row's cell: OOM when the GPU (or the KV cache) ran out of memory, else `error`."""
    error = row["error"].lower()
    if row["error"] == UNFINISHED:
        return "timeout"
    return "OOM" if "outofmemory" in error or "out of memory" in error or "kv cache" in error else "error"


def details_table(rows: list[dict]) -> str:
    """One line per configuration and length: the figures behind the main table's cells."""
    lines = ["| configuration | prompt tokens | mean s | warm-up s | prefill s | exchange ms | exposed ms | hidden "
             "| peak GiB/GPU | kernel |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        warm = ", ".join(f"{t / 1e3:.3f}" for t in r.get("warmup_ttft_ms_samples", []))
        if r.get("error"):
            lines.append(f"| {r['label']} | {r['prompt_tokens']} | {failure(r)} | {warm} | | | | | | |")
            continue
        exchange = r.get("mean_exchange_ms")
        lines.append(
            f"| {r['label']} | {r['prompt_tokens']} | {r['mean_ttft_ms'] / 1e3:.3f} | {warm} | "
            f"{r['mean_server_prefill_ms'] / 1e3:.3f} | " + (
                f"{exchange:.1f} | {r['mean_exposed_ms']:.1f} | {r['hidden_fraction']:.0%} | " if exchange
                else "| | | ") + f"{r.get('peak_memory_gib', 0):.1f} | {r.get('kernel', '')} |")
    return "\n".join(lines) + "\n"


def workers(row: dict) -> int:
    """How many workers (GPUs) a row ran on: its context_parallel_size; in results written before
    2026-11-23, num_devices, else the length of its device list ('cuda:0,cuda:1' -> 2); 0 if unknown."""
    for key in ("context_parallel_size", "num_devices"):
        if row.get(key):
            return int(row[key])
    devices = row.get("devices") or ""
    return len(devices.split(",")) if devices else 0


def scaling_table(rows: list[dict], length: int) -> str:
    """Configurations (by strategy) x device counts at one prompt length: mean TTFT s and the
    speed-up over transformers on one device when that was measured in the same results."""
    at = [r for r in rows if r["prompt_tokens"] == length]
    counts = sorted({workers(r) for r in at})
    strategies = list(dict.fromkeys(r["strategy"] for r in at))
    base = next((r for r in at if r["strategy"] == "transformers" and not r.get("error")), None)
    strategies = [s for s in strategies if s != "single" or len(strategies) == 1]
    lines = [f"| strategy ({length} tokens) | " + " | ".join(f"{g} GPU" for g in counts) + " |",
             "|---|" + "---|" * len(counts)]
    single = next((r for r in at if r["strategy"] == "single"), None)
    for strategy in strategies:
        cells = []
        for g in counts:
            row = next((r for r in at if r["strategy"] == strategy and workers(r) == g), None)
            if row is None and g == 1 and strategy not in ("transformers", "single"):
                row = single      # every engine strategy is the same computation on one device
            cell = _cell(row)
            if row is not None and not row.get("error"):
                cell = f"{row['mean_ttft_ms'] / 1e3:.3f}"
                if base is not None:
                    cell += f" ({base['mean_ttft_ms'] / row['mean_ttft_ms']:.2f}x)"
            cells.append(cell)
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_scaling(rows: list[dict], length: int, path: str) -> None:
    """TTFT vs device count at one prompt length, one line per strategy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    at = [r for r in rows if r["prompt_tokens"] == length and not r.get("error")]
    fig, ax = plt.subplots(figsize=(6, 4))
    single = {workers(r): r["mean_ttft_ms"] / 1e3 for r in at if r["strategy"] == "single"}
    for strategy in dict.fromkeys(r["strategy"] for r in at):
        if strategy == "single":
            continue
        points = {workers(r): r["mean_ttft_ms"] / 1e3 for r in at if r["strategy"] == strategy}
        if strategy != "transformers":
            points = {**single, **points}
        points = sorted(points.items())
        ax.plot(*zip(*points), marker="o", linestyle="-" if len(points) > 1 else "none", label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    counts = sorted({workers(r) for r in at})
    ax.set_xticks(counts, [str(g) for g in counts])
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_ylabel(f"time to first token at {length} tokens (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def this_machine() -> str:
    """`N x GPU name` from nvidia-smi, else the CPU count."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
        names = [n.strip() for n in names if n.strip()]
        if names:
            return f"{len(names)} x {names[0]}"
    except (OSError, subprocess.SubprocessError):
        pass
    return f"CPU, {os.cpu_count()} cores"


def write_doc_section(doc: str, section: str, title: str, runs: list[dict], rows: list[dict], output_dir: str,
                      scaling_length: int) -> None:
    """Writes (or replaces) a marked section of a markdown file: the commands, date and machine of
    every merged run, the table, the plots (copied next to the file) and the details."""
    slug = re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")
    image_dir = os.path.join(os.path.dirname(doc) or ".", "img")
    os.makedirs(image_dir, exist_ok=True)
    machines = sorted({r.get("machine") or "?" for r in runs})
    dates = sorted({r.get("date") or "?" for r in runs})
    counts = {(r.get("repeats"), r.get("warmup")) for r in runs}
    lines = [f"<!-- bench:{slug}:begin -->", f"## {title}", "",
             f"Date: {', '.join(dates)}  ", f"Machine: {', '.join(machines)}  ",
             "Written by: `burstserve bench merge ... --doc` over these runs, one process each:", ""]
    lines += [f"- `{r.get('command', '?')}`" for r in runs]
    lines += ["", "Time to first token in seconds: mean (std) over the measured requests of each length, "
              "after " + "; ".join(f"{w} warm-up request(s) and {n} measured" for n, w in sorted(counts, key=str))
              + ". OOM: out of GPU memory; timeout: not finished within the run's time limit. " + NOT_RUN + ".", ""]
    if len({r["prompt_tokens"] for r in rows}) > 1:
        shutil.copy(os.path.join(output_dir, "ttft.png"), os.path.join(image_dir, f"{slug}-ttft.png"))
        lines += [sweep_table(rows, {}).split("\n", 2)[2].rstrip("\n"), "",
                  f"![time to first token vs prompt length](img/{slug}-ttft.png)", ""]
    if scaling_length and len({workers(r) for r in rows if r["prompt_tokens"] == scaling_length}) > 1:
        plot_scaling(rows, scaling_length, os.path.join(image_dir, f"{slug}-scaling.png"))
        lines += [f"Scaling at {scaling_length} tokens: seconds (speed-up over transformers on one GPU). The "
                  "1-GPU cell of an engine strategy is the engine on one GPU (`single`): every strategy is the "
                  "same computation there.", "",
                  scaling_table(rows, scaling_length).rstrip("\n"), "",
                  f"![scaling](img/{slug}-scaling.png)", ""]
    if decoded(rows):
        plot_tpot(rows, os.path.join(image_dir, f"{slug}-tpot.png"))
        lines += [decode_table(rows).strip("\n"), "", f"![time per output token vs prompt length](img/{slug}-tpot.png)",
                  ""]
    lines += ["Details. Warm-up: the TTFT of the first request(s) of that length (kernel plans for new shapes). "
              "Prefill: the workers' own time. Exchange: all layers' K/V ring exchanges alone (from a ring "
              "step's latency and bandwidth timed at worker start); exposed: "
              "time compute stalled waiting for them (including waiting for a slower peer); hidden = 1 - "
              "exposed / exchange. Peak: the largest peak of allocated GPU memory over the workers.", "",
              details_table(rows).rstrip("\n"), f"<!-- bench:{slug}:end -->", ""]
    replace_section(doc, f"<!-- bench:{slug}:begin -->", f"<!-- bench:{slug}:end -->", "\n".join(lines))


def replace_section(path: str, begin: str, end: str, section: str) -> None:
    """Puts `section` (which starts with `begin` and ends with `end`) in place of the old one, else at the end."""
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end) + 1:]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as f:
        f.write(text)

def plot_sweep(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r["label"] for r in rows):
        points = sorted((r["prompt_tokens"], r["mean_ttft_ms"] / 1e3) for r in rows
                        if r["label"] == label and not r.get("error"))
        if points:                   # (a configuration that failed everywhere: the lines under the table)
            ax.plot(*zip(*points), marker="o", label=plot_label(label, rows))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:      # none yet while the first length is being measured
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tpot(rows: list[dict], path: str) -> None:
    """Mean time per output token vs prompt length, one line per configuration (rows that decoded)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in decoded(rows) if not r.get("error")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(r["label"] for r in rows):
        points = sorted((r["prompt_tokens"], r["mean_tpot_ms"]) for r in rows if r["label"] == label)
        ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time per output token (ms)")
    ax.grid(True, which="both", alpha=0.3)
    if rows:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_load(output_dir: str, result: dict) -> None:
    scalars = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
    shown = {**scalars, "max_concurrency": scalars.get("max_concurrency") or "no limit"}
    write_result_files(output_dir, {"mode": "load", **result}, list(scalars), [scalars],
                       "| metric | value |\n|---|---|\n" + "".join(
                           f"| {k} | {v:.3f} |\n" if isinstance(v, float) else f"| {k} | {v} |\n"
                           for k, v in shown.items() if v is not None))   # None: a figure no request gave
    plot_load(result, os.path.join(output_dir, "latency.png"))


def plot_load(result: dict, path: str) -> None:
    """Histograms of the requests' TTFT and end-to-end latency (ms)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, name in ((axes[0], "ttfts", "time to first token"), (axes[1], "e2els", "end-to-end latency")):
        ax.hist([t * 1e3 for t in result.get(key, [])], bins=30)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("requests")
    fig.suptitle(f"{result.get('label') or 'load'}: {result.get('completed', 0)} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(paths: list[str], output_dir: str, lengths: list[int] | None = None) -> tuple[list[dict], list[dict]]:
    """Several sweeps' results.json (their rows of `lengths` only, if given) into one table and plot.
    -> (the merged rows, each run's whole results.json)."""
    rows, runs = [], []
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        if data.get("mode") != "sweep":
            raise ValueError(f"{p} is not a sweep's results.json")
        rows += [r for r in data["rows"] if lengths is None or r["prompt_tokens"] in lengths]
        runs.append(data)
    note = " ".join(run["note"] for run in runs if run.get("note"))
    write_sweep(output_dir, rows, {"note": note, "merged_from": paths})
    return rows, runs

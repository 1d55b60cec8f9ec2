"""First prefill table: time to first token of the engine on 1..G GPUs next to transformers on one
GPU, measured in the same run, written into docs/benchmarks.md.

    python -m clients.prefill_table --model llama3-8b --lengths 32768,131072 --gpus 1,2 \\
        --output docs/benchmarks.md

Each configuration starts its own engine (random preset weights, bf16), warms up on a short prompt,
then sends each prompt length `--repeats` times with max_tokens=1 and keeps the best. TTFT is the
offline API's submit-to-first-token time; prefill is the workers' own time for the prefill alone.
"""
import argparse
import datetime
import json
import os
import random
import subprocess
import sys

import torch

from engine import LLM, EngineDeadError, SamplingParams

BEGIN, END = "<!-- prefill_table:begin -->", "<!-- prefill_table:end -->"


def measure_engine(model: str, gpus: int, lengths: list[int], repeats: int, overlap: bool) -> list[dict]:
    rows = []
    llm = LLM(model, devices=f"cuda:{gpus}", dtype="bfloat16", overlap=overlap)
    vocab = llm.model_config.vocab_size
    try:
        llm.generate([[random.randrange(vocab) for _ in range(1024)]], SamplingParams(max_tokens=1))  # warm-up
        for n in lengths:
            best, first = None, None
            for _ in range(repeats):
                try:
                    out = llm.generate([[random.randrange(vocab) for _ in range(n)]],
                                       SamplingParams(temperature=0, max_tokens=1))[0]
                except EngineDeadError as e:
                    rows.append({"gpus": gpus, "prompt_tokens": n, "overlap": overlap,
                                 "oom": "OutOfMemory" in str(e), "error": str(e)[:300]})
                    llm.shutdown()
                    llm = LLM(model, devices=f"cuda:{gpus}", dtype="bfloat16", overlap=overlap)
                    break
                m = out.metrics
                row = {"gpus": gpus, "prompt_tokens": n, "overlap": overlap, "kernel": llm.kernel,
                       "ttft_seconds": m.time_to_first_token, "prefill_seconds": m.prefill_seconds,
                       **{k: v for k, v in m.prefill_stats.items() if k != "prefill_seconds"}}
                first = first if first is not None else row["ttft_seconds"]
                if best is None or row["ttft_seconds"] < best["ttft_seconds"]:
                    best = row
            if best:
                rows.append(dict(best, first_ttft_seconds=first))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        llm.shutdown()
    return rows


def measure_transformers(model: str, lengths: list[int], repeats: int) -> list[dict]:
    cmd = [sys.executable, "-m", "clients.hf_baseline", "--model", model, "--lengths",
           ",".join(map(str, lengths)), "--repeats", str(repeats)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    done = {r["prompt_tokens"] for r in rows}
    for n in lengths:
        if n not in done:   # the process died (an OOM outside the caught call, say)
            rows.append({"prompt_tokens": n, "oom": "OutOfMemory" in proc.stderr, "error": proc.stderr[-300:]})
    return rows


def _cell(row: dict | None, key: str = "ttft_seconds") -> str:
    if row is None:
        return "-"
    if row.get("oom"):
        return "OOM"
    if "error" in row:
        return "error"
    return f"{row[key]:.3f}"


def render(model: str, lengths, gpus, engine_rows, hf_rows, command: str) -> str:
    machine = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "?"
    find = {(r["gpus"], r["prompt_tokens"], r["overlap"]): r for r in engine_rows}
    hf = {r["prompt_tokens"]: r for r in hf_rows}
    lines = [BEGIN, f"## Prefill: time to first token, `{model}` preset (bf16, batch 1)", "",
             f"Command: `{command}`  ", f"Date: {datetime.date.today().isoformat()}  ", f"Machine: {machine}", "",
             "Seconds, best of the repeats; transformers is `LlamaForCausalLM` (sdpa) on one GPU, same run.", "",
             "| prompt tokens | transformers, 1 GPU | " + " | ".join(f"burst, {g} GPU" for g in gpus) + " |",
             "|---|---|" + "---|" * len(gpus)]
    for n in lengths:
        cells = [_cell(hf.get(n), "seconds")] + [_cell(find.get((g, n, True))) for g in gpus]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "Details per engine run. TTFT: best of the repeats; first TTFT: the first request of that length "
              "(it builds cuDNN plans for new shapes and times the exchanges alone). Prefill: the workers' own time. "
              "Exchange: all layers' K/V exchanges timed alone; exposed: time compute stalled waiting for them "
              "(with overlap off this includes waiting for the slower peer); hidden = 1 - exposed / exchange.", "",
              "| GPUs | prompt tokens | overlap | kernel | TTFT s | first TTFT s | prefill s | exchange s | exposed s "
              "| hidden | peak GiB/GPU |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in engine_rows:
        if "ttft_seconds" not in r:
            lines.append(f"| {r['gpus']} | {r['prompt_tokens']} | {r['overlap']} | | {_cell(r)} | | | | | | |")
            continue
        lines.append(f"| {r['gpus']} | {r['prompt_tokens']} | {r['overlap']} | {r['kernel']} | {r['ttft_seconds']:.3f} "
                     f"| {r['first_ttft_seconds']:.3f} | {r['prefill_seconds']:.3f} | {r.get('exchange_seconds', 0):.3f} | "
                     f"{r.get('exposed_seconds', 0):.3f} | {r.get('hidden_fraction', 0):.0%} | "
                     f"{r.get('peak_memory_bytes', 0) / 2**30:.1f} |")
    return "\n".join(lines + [END, ""])


def write_section(path: str, section: str) -> None:
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END) + 1:]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-overlap-too", action="store_true", help="also run every multi-GPU case without overlap")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--output", default="docs/benchmarks.md")
    ap.add_argument("--json", default=None, help="also write the raw rows here")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    gpus = [int(x) for x in args.gpus.split(",")]
    hf_rows = [] if args.skip_transformers else measure_transformers(args.model, lengths, args.repeats)
    for r in hf_rows:
        print(json.dumps({"transformers": r}), flush=True)
    engine_rows = []
    for g in gpus:
        engine_rows += measure_engine(args.model, g, lengths, args.repeats, overlap=True)
        if args.no_overlap_too and g > 1:
            engine_rows += measure_engine(args.model, g, lengths, args.repeats, overlap=False)
    command = "python -m clients.prefill_table " + " ".join(sys.argv[1:])
    section = render(args.model, lengths, gpus, engine_rows, hf_rows, command)
    print(section)
    write_section(args.output, section)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": engine_rows, "transformers": hf_rows}, f, indent=1)


if __name__ == "__main__":
    main()

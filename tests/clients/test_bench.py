"""`burstserve bench`: sweep, load, offline and merge write their files, with numbers from the measured requests."""
import csv
import json
import os
import random
import statistics
import subprocess
import sys

import pytest
import torch

from burstserve.clients.server_process import RemoteServer
from paths import ROOT
from burstserve.clients.shared import SOURCES, source

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VLLM_KEYS = ["duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "total_token_throughput"] + [
    f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")]


def bench(*args) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "burstserve.server.cli", "bench", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def check_sweep_outputs(out_dir, lengths, repeats, label):
    data = json.load(open(os.path.join(out_dir, "results.json")))
    rows = data["rows"]
    assert [r["prompt_tokens"] for r in rows] == lengths
    for r in rows:
        assert r["label"] == label and not r["error"] and r["repeats"] == repeats
        assert len(r["ttft_ms_samples"]) == repeats and all(t > 0 for t in r["ttft_ms_samples"])
        assert r["mean_ttft_ms"] == pytest.approx(statistics.fmean(r["ttft_ms_samples"]))
        assert r["std_ttft_ms"] == pytest.approx(statistics.pstdev(r["ttft_ms_samples"]))
        assert 0 < r["mean_server_prefill_ms"] <= r["mean_ttft_ms"]
    with open(os.path.join(out_dir, "results.csv")) as f:
        assert [int(r["prompt_tokens"]) for r in csv.DictReader(f)] == lengths
    table = open(os.path.join(out_dir, "results.md")).read()
    assert label in table and all(f"| {n} |" in table for n in lengths)
    assert open(os.path.join(out_dir, "ttft.png"), "rb").read(8) == PNG_MAGIC
    return rows


def test_sweep_against_a_server_it_starts(tmp_path):
    out = tmp_path / "sweep"
    bench("sweep", "--serve", "--model tiny --devices cpu -cp 2", "--lengths", "64,300", "--repeats", "2",
          "--label", "burst-cpu2", "--output-dir", str(out))
    rows = check_sweep_outputs(str(out), [64, 300], 2, "burst-cpu2")
    assert rows[0]["strategy"] == "burst" and rows[0]["num_devices"] == 2


def test_offline_sweep_and_merge(tmp_path):
    bench("sweep", "--offline", "--model", "tiny", "--devices", "cpu", "-cp", "2", "--sp-strategy", "ring-rsa",
          "--lengths", "32,128", "--repeats", "2", "--label", "rsa", "--output-dir", str(tmp_path / "a"))
    check_sweep_outputs(str(tmp_path / "a"), [32, 128], 2, "rsa")
    bench("sweep", "--offline", "--model", "tiny", "--devices", "cpu", "-cp", "2", "--lengths", "32,128",
          "--repeats", "1", "--label", "burst", "--output-dir", str(tmp_path / "b"))
    printed = bench("merge", str(tmp_path / "a" / "results.json"), str(tmp_path / "b" / "results.json"),
                    "--output-dir", str(tmp_path / "m"))
    assert "| prompt tokens | rsa | burst |" in printed
    merged = json.load(open(tmp_path / "m" / "results.json"))["rows"]
    assert len(merged) == 4
    assert open(tmp_path / "m" / "ttft.png", "rb").read(8) == PNG_MAGIC


def test_load_mode_reports_vllm_metrics(tmp_path):
    server = RemoteServer(["--model", "tiny", "--devices", "cpu", "-cp", "2"])
    try:
        bench("load", "--url", server.url(""), "--num-prompts", "12", "--input-len", "40", "--output-len", "5",
              "--max-concurrency", "4", "--request-rate", "50", "--output-dir", str(tmp_path / "load"))
    finally:
        server.stop()
    result = json.load(open(tmp_path / "load" / "results.json"))
    for key in VLLM_KEYS:
        assert key in result, key
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_input_tokens"] == 12 * 40 and result["total_output_tokens"] == 12 * 5
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"] and result["mean_itl_ms"] > 0
    assert result["request_throughput"] == pytest.approx(12 / result["duration"])
    assert os.path.exists(tmp_path / "load" / "results.csv") and os.path.exists(tmp_path / "load" / "results.md")
    assert len(result["ttfts"]) == 12 and statistics.fmean(result["ttfts"]) * 1e3 == pytest.approx(result["mean_ttft_ms"])
    assert statistics.fmean(result["e2els"]) * 1e3 == pytest.approx(result["mean_e2el_ms"])
    assert open(tmp_path / "load" / "latency.png", "rb").read(8) == PNG_MAGIC
    table = open(tmp_path / "load" / "results.md").read()
    assert "None" not in table and "| max_concurrency | 4 |" in table, table
    from burstserve.clients import report
    assert result["machine"] == report.this_machine() and result["date"] and "bench load" in result["command"]


def test_the_load_table_shows_no_none(tmp_path):
    """A figure no request gave (TPOT of one-token answers) is left out of results.md (kept in results.json as
    null, as vllm bench serve keeps it), and no concurrency limit reads so."""
    from burstserve.clients import report
    report.write_load(str(tmp_path), {"label": None, "completed": 3, "max_concurrency": None, "mean_tpot_ms": None,
                                      "mean_ttft_ms": 1.5, "ttfts": [0.001] * 3, "e2els": [0.002] * 3})
    table = open(tmp_path / "results.md").read()
    assert "None" not in table and "| max_concurrency | no limit |" in table and "| mean_ttft_ms | 1.500 |" in table
    assert json.load(open(tmp_path / "results.json"))["mean_tpot_ms"] is None


def test_transformers_baseline_sweep_and_doc_section(tmp_path):
    """transformers on one CPU device through the same sweep, merged with an engine sweep into a
    markdown section whose cells are the measured means; a rerun replaces the section."""
    bench("sweep", "--offline", "--model", "tiny", "--devices", "cpu", "--sp-strategy", "transformers",
          "--lengths", "48,160", "--repeats", "2", "--warmup", "1", "--label", "hf", "--output-dir", str(tmp_path / "hf"))
    hf = check_sweep_outputs(str(tmp_path / "hf"), [48, 160], 2, "hf")
    assert all(r["strategy"] == "transformers" and len(r["warmup_ttft_ms_samples"]) == 1 for r in hf)
    bench("sweep", "--offline", "--model", "tiny", "--devices", "cpu", "--sp-strategy", "single",
          "--lengths", "48,160", "--repeats", "1", "--label", "one", "--output-dir", str(tmp_path / "one"))
    bench("sweep", "--offline", "--model", "tiny", "--devices", "cpu", "-cp", "2", "--lengths", "160", "--repeats", "1",
          "--label", "two", "--output-dir", str(tmp_path / "two"))
    doc = tmp_path / "docs" / "bench.md"
    doc.parent.mkdir()
    doc.write_text("# Mine\n\nkept text\n")
    paths = [str(tmp_path / d / "results.json") for d in ("hf", "one", "two")]
    for _ in range(2):   # the second run replaces the section
        bench("merge", *paths, "--output-dir", str(tmp_path / "m"), "--doc", str(doc), "--section", "tiny cpu",
              "--title", "Tiny on CPU", "--scaling-length", "160")
    text = doc.read_text()
    assert text.startswith("# Mine\n\nkept text\n") and text.count("## Tiny on CPU") == 1
    assert text.count("<!-- bench:tiny-cpu:begin -->") == 1 and text.count("<!-- bench:tiny-cpu:end -->") == 1
    rows = {(r["label"], r["prompt_tokens"]): r for p in paths for r in json.load(open(p))["rows"]}
    table = text[text.index("| prompt tokens |"):]
    line_160 = next(line for line in table.splitlines() if line.startswith("| 160 |"))
    for label in ("hf", "one", "two"):
        r = rows[(label, 160)]
        assert f"{r['mean_ttft_ms'] / 1e3:.3f} ({r['std_ttft_ms'] / 1e3:.3f})" in line_160
    assert "| 48 |" in table and "| 48 | " + f"{rows[('hf', 48)]['mean_ttft_ms'] / 1e3:.3f}" in table
    # scaling: the engine's one-device figure fills burst's 1-device cell, speed-up against transformers
    burst_line = next(line for line in text.splitlines() if line.startswith("| burst |"))
    one, two, base = rows[("one", 160)], rows[("two", 160)], rows[("hf", 160)]
    assert f"{one['mean_ttft_ms'] / 1e3:.3f} ({base['mean_ttft_ms'] / one['mean_ttft_ms']:.2f}x)" in burst_line
    assert f"{two['mean_ttft_ms'] / 1e3:.3f} ({base['mean_ttft_ms'] / two['mean_ttft_ms']:.2f}x)" in burst_line
    for image in ("tiny-cpu-ttft.png", "tiny-cpu-scaling.png"):
        assert (doc.parent / "img" / image).read_bytes()[:8] == PNG_MAGIC


def test_merge_keeps_only_the_asked_lengths(tmp_path):
    bench("sweep", "--offline", "--model", "tiny", "--devices", "cpu", "--lengths", "24,72", "--repeats", "1",
          "--warmup", "0", "--label", "a", "--output-dir", str(tmp_path / "a"))
    data = json.load(open(tmp_path / "a" / "results.json"))
    assert data["warmup"] == 0 and all(r["warmup_ttft_ms_samples"] == [] for r in data["rows"])
    bench("merge", str(tmp_path / "a" / "results.json"), "--lengths", "72", "--output-dir", str(tmp_path / "m"))
    merged = json.load(open(tmp_path / "m" / "results.json"))["rows"]
    assert [r["prompt_tokens"] for r in merged] == [72]


def test_failed_and_unfinished_cells():
    from types import SimpleNamespace
    from burstserve.clients import report
    oom = {"label": "x", "prompt_tokens": 8, "error": "EngineDeadError: worker 1 failed: OutOfMemoryError: CUDA "
                                                       "out of memory. Tried to allocate 128.00 GiB"}
    assert report.failure(oom) == "OOM"
    assert report.failure(dict(oom, error="InvalidRequestError: the request needs 9 tokens of KV cache")) == "OOM"
    assert report.failure(dict(oom, error="RuntimeError: NCCL timeout")) == "error"
    args = SimpleNamespace(label="lbl", sp_strategy="cqs")
    pending = report.unfinished_row(args, 4096, None)
    assert report.failure(pending) == "timeout" and pending["label"] == "lbl" and pending["strategy"] == "cqs"
    table = report.sweep_table([dict(oom, mean_ttft_ms=0, std_ttft_ms=0), dict(pending, label="x")], {})
    assert "| 8 | OOM |" in table and "| 4096 | timeout |" in table


def test_a_failed_length_says_why_under_the_table_and_in_the_plots_legend(tmp_path):
    """A failed cell reads OOM or error; the reason (the error's first line) is written under the table, and
    the plot's legend names the lengths it has no point for."""
    from burstserve.clients import report
    ok = {"label": "x", "prompt_tokens": 8, "mean_ttft_ms": 100.0, "std_ttft_ms": 0.0, "error": None}
    refused = {"label": "x", "prompt_tokens": 16, "mean_ttft_ms": 0.0, "std_ttft_ms": 0.0,
               "error": "InvalidRequestError: 16 tokens is more than max_model_len 12\nTraceback ..."}
    report.write_sweep(str(tmp_path), [ok, refused], {})
    md = open(tmp_path / "results.md").read()
    assert "| 16 | error |" in md
    assert "- `x` at 16 tokens, error: InvalidRequestError: 16 tokens is more than max_model_len 12\n" in md
    assert "Traceback" not in md and os.path.getsize(tmp_path / "ttft.png") > 0
    assert report.plot_label("x", [ok, refused]) == "x (error at 16)" and report.plot_label("x", [ok]) == "x"
    assert report.failures([ok]) == ""


# ---- decode: --output-len and --batch ------------------------------------------------------------------------
OLD_RESULTS = os.path.join(ROOT, "docs", "results", "2026-11-22-4xH200", "llama3-8b", "transformers-1", "results.json")


def check_decode_rows(rows, output_len, batch, repeats):
    """Every request's samples are there, TPOT is (e2e - TTFT) / (N - 1), each batch's generated tokens/s
    is its tokens over a wall time no shorter than its slowest request."""
    for r in rows:
        requests = batch * repeats
        assert not r["error"] and r["output_len"] == output_len and r["batch"] == batch and r["repeats"] == repeats
        assert r["output_tokens_samples"] == [output_len] * requests
        assert len(r["ttft_ms_samples"]) == len(r["tpot_ms_samples"]) == len(r["e2el_ms_samples"]) == requests
        for ttft, tpot, e2el in zip(r["ttft_ms_samples"], r["tpot_ms_samples"], r["e2el_ms_samples"]):
            assert 0 < ttft < e2el and tpot > 0
            assert tpot == pytest.approx((e2el - ttft) / (output_len - 1), rel=1e-6)
        tpots = r["tpot_ms_samples"]
        assert r["mean_tpot_ms"] == pytest.approx(statistics.fmean(tpots))
        assert r["median_tpot_ms"] == pytest.approx(statistics.median(tpots))
        assert r["median_tpot_ms"] <= r["p99_tpot_ms"] <= max(tpots)
        assert len(r["output_tokens_per_s_samples"]) == len(r["decode_tokens_per_s_samples"]) == repeats
        for j, rate in enumerate(r["output_tokens_per_s_samples"]):
            slowest = max(r["e2el_ms_samples"][j * batch:(j + 1) * batch]) / 1e3
            wall = batch * output_len / rate            # seconds from the first send to the last token
            assert slowest * (1 - 1e-6) <= wall <= slowest + 0.5
        assert all(d > 0 for d in r["decode_tokens_per_s_samples"])
        assert r["mean_output_tokens_per_s"] == pytest.approx(statistics.fmean(r["output_tokens_per_s_samples"]))
        assert r["mean_decode_tokens_per_s"] == pytest.approx(statistics.fmean(r["decode_tokens_per_s_samples"]))


def test_batch_throughput_counts_only_tokens_after_the_last_first_token():
    from burstserve.clients.stats import RequestTiming, batch_throughput
    early = RequestTiming(sent=0.0, token_times=[1.0, 2.0, 3.0, 4.0])     # decodes while `late` prefills
    late = RequestTiming(sent=0.5, token_times=[3.0, 5.0, 6.0, 7.0])
    assert early.ttft == 1.0 and late.ttft == 2.5
    assert early.tpot == pytest.approx(1.0) and late.tpot == pytest.approx(4 / 3)
    output, decode = batch_throughput([early, late])
    assert output == pytest.approx(8 / 7)                 # 8 tokens, first send 0.0 to last token 7.0
    assert decode == pytest.approx(4 / 4)                  # after 3.0: 4.0 of early, 5, 6, 7 of late; 4 s
    assert batch_throughput([RequestTiming(0.0, [0.25])]) == (4.0, None)
    assert batch_throughput([early])[1] == pytest.approx(1 / early.tpot)


def test_output_len_flag_and_its_old_name():
    import argparse
    from burstserve.clients.bench import add_parser
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    sweep = lambda *a: parser.parse_args(["bench", "sweep", *a])   # noqa: E731
    assert (sweep().output_len, sweep().batch) == (1, 1)
    assert sweep("--output-len", "16", "--batch", "4").output_len == 16
    assert sweep("--max-tokens", "7").output_len == 7
    for bad in (["--output-len", "0"], ["--batch", "0"]):
        with pytest.raises(SystemExit):
            sweep(*bad)


def test_offline_sweep_decodes_a_batch_and_old_results_still_merge(tmp_path):
    bench("sweep", "--offline", "--model", "tiny", "--devices", "cpu", "--lengths", "32,64", "--repeats", "2",
          "--output-len", "4", "--batch", "3", "--label", "dec", "--output-dir", str(tmp_path / "dec"))
    data = json.load(open(tmp_path / "dec" / "results.json"))
    assert (data["output_len"], data["batch"]) == (4, 3)
    check_decode_rows(data["rows"], 4, 3, 2)
    r = data["rows"][1]
    table = open(tmp_path / "dec" / "results.md").read()
    line = (f"| dec | 64 | 3 | 4 | {r['mean_ttft_ms'] / 1e3:.3f} | {r['mean_tpot_ms']:.2f} | {r['median_tpot_ms']:.2f} | "
            f"{r['p99_tpot_ms']:.2f} | {r['mean_output_tokens_per_s']:.1f} | {r['mean_decode_tokens_per_s']:.1f} |")
    assert line in table
    with open(tmp_path / "dec" / "results.csv") as f:
        assert [float(c["mean_tpot_ms"]) for c in csv.DictReader(f)] == pytest.approx(
            [row["mean_tpot_ms"] for row in data["rows"]])
    assert open(tmp_path / "dec" / "tpot.png", "rb").read(8) == PNG_MAGIC
    # an old run (no output_len, no TPOT) merged with it: its TTFT cells as before, no decode line of its own
    old = json.load(open(OLD_RESULTS))["rows"]
    doc = tmp_path / "bench.md"
    bench("merge", OLD_RESULTS, str(tmp_path / "dec" / "results.json"), "--output-dir", str(tmp_path / "m"),
          "--doc", str(doc), "--section", "mixed", "--scaling-length", "0")
    text = doc.read_text()
    ok = next(row for row in old if not row.get("error"))
    line = next(line for line in text.splitlines() if line.startswith(f"| {ok['prompt_tokens']} |"))
    assert f"{ok['mean_ttft_ms'] / 1e3:.3f} ({ok['std_ttft_ms'] / 1e3:.3f})" in line
    decode_lines = [line for line in text.splitlines() if line.count("|") == 12 and line.startswith("| ")]
    assert [line.split(" | ")[:2] for line in decode_lines[1:]] == [["| dec", "32"], ["| dec", "64"]]
    assert (tmp_path / "img" / "mixed-tpot.png").read_bytes()[:8] == PNG_MAGIC
    with open(tmp_path / "m" / "results.csv") as f:
        cells = list(csv.DictReader(f))
    assert [c["mean_tpot_ms"] for c in cells[:len(old)]] == [""] * len(old)


def test_decode_table_keeps_failed_rows_and_skips_ttft_only_results():
    from types import SimpleNamespace
    from burstserve.clients import report
    assert report.decode_table([{"label": "old", "prompt_tokens": 8, "error": None, "mean_ttft_ms": 1.0}]) == ""
    pending = report.unfinished_row(SimpleNamespace(label="x", sp_strategy="burst", output_len=8, batch=16), 8192,
                                    None)
    assert "| x | 8192 | 16 | 8 | timeout |" in report.decode_table([pending])


def test_http_sweep_decodes_concurrent_streams(tmp_path):
    bench("sweep", "--serve", "--model tiny --devices cpu", "--lengths", "40", "--repeats", "2", "--output-len", "5",
          "--batch", "2", "--output-dir", str(tmp_path / "http"))
    rows = json.load(open(tmp_path / "http" / "results.json"))["rows"]
    check_decode_rows(rows, 5, 2, 2)
    assert rows[0]["label"] == "burst, 1 device(s), batch 2" and rows[0]["mean_server_prefill_ms"] > 0


def test_transformers_peer_decodes_on_cpu(tmp_path):
    bench("sweep", "--offline", "--model", "tiny", "--devices", "cpu", "--sp-strategy", "transformers",
          "--lengths", "24", "--repeats", "2", "--output-len", "3", "--batch", "2", "--label", "hf",
          "--output-dir", str(tmp_path / "hf"))
    rows = json.load(open(tmp_path / "hf" / "results.json"))["rows"]
    check_decode_rows(rows, 3, 2, 2)
    r = rows[0]
    assert r["decode_mode"] == "dynamic, eager" and "dynamic, eager |" in open(tmp_path / "hf" / "results.md").read()
    # one generate call per batch: its requests share every reading, so decode tokens/s is batch / TPOT
    assert r["tpot_ms_samples"][0] == r["tpot_ms_samples"][1] and r["ttft_ms_samples"][0] == r["ttft_ms_samples"][1]
    for j, decode in enumerate(r["decode_tokens_per_s_samples"]):
        assert decode == pytest.approx(2 / (r["tpot_ms_samples"][2 * j] / 1e3))


# ---- shared: cold and warm TTFT on one document (prefix cache), multi-turn ------------------------------------
def check_shared(out_dir, per_run: int, repeats: int) -> dict:
    """results.json: every run's cold request first with nothing cached, its figures the table's; results.md:
    the table, a line per repeat (and one over all of them)."""
    data = json.load(open(os.path.join(out_dir, "results.json")))
    assert data["mode"] == "shared" and not data["error"] and not data["warnings"]
    assert len(data["runs"]) == repeats and len(data["warmup_runs"]) == 1
    for run in data["runs"] + data["warmup_runs"]:
        assert [x["index"] for x in run] == list(range(1, per_run + 1))
        assert run[0]["cached_tokens"] == 0 and not run[0]["warm"] and all(x["warm"] for x in run[1:])
        assert all(x["ttft_ms"] > 0 and 0 < x["server_prefill_ms"] for x in run)
    s = data["summary"]
    warm = [x for run in data["runs"] for x in run[1:]]
    assert s["mean_warm_ttft_ms"] == pytest.approx(statistics.fmean(x["ttft_ms"] for x in warm))
    assert s["max_warm_ttft_ms"] == pytest.approx(max(x["ttft_ms"] for x in warm))
    assert s["speedup"] == pytest.approx(s["mean_cold_ttft_ms"] / s["mean_warm_ttft_ms"])
    table = open(os.path.join(out_dir, "results.md")).read()
    assert ("| cold TTFT s | warm TTFT s mean | warm p50 | warm max | cached tokens (warm) | speed-up cold/warm |"
            in table)
    first = data["runs"][0]
    assert f"| 1 | {first[0]['ttft_ms'] / 1e3:.3f} | " in table and f"{s['speedup']:.2f}x |" in table
    return data


def test_shared_document_offline_hits_the_cached_document(tmp_path):
    out = tmp_path / "shared"
    printed = bench("shared", "--offline", "--model", "tiny", "--devices", "cpu", "--doc-len", "200", "--question-len",
                    "20", "--questions", "3", "--repeats", "1", "--output-dir", str(out))
    data = check_shared(str(out), 3, 1)
    assert data["kind"] == "document" and data["label"] == "burst, 1 device(s), offline" and data["output_len"] == 1
    run = data["runs"][0]
    assert [x["prompt_tokens"] for x in run] == [220] * 3
    assert all(x["cached_tokens"] >= 200 for x in run[1:])
    assert data["summary"]["min_warm_cached_tokens"] >= 200 and data["summary"]["warm_without_cache_hit"] == 0
    assert "| document | cold TTFT s |" in printed and "| 1 | " in printed
    with open(out / "results.csv") as f:
        assert [int(r["cached_tokens"]) >= 200 for r in csv.DictReader(f) if r["repeat"] == "1"] == [False, True, True]


def test_shared_multi_turn_offline_caches_each_previous_turn(tmp_path):
    out = tmp_path / "turns"
    bench("shared", "--offline", "--model", "tiny", "--devices", "cpu", "--turns", "3", "--output-len", "4",
          "--question-len", "10", "--doc-len", "100", "--repeats", "2", "--max-num-batched-tokens", "48",
          "--output-dir", str(out))
    data = check_shared(str(out), 3, 2)
    assert data["kind"] == "multi-turn" and data["max_num_batched_tokens"] == 48
    for run in data["runs"]:
        # turn t: turn t-1's prompt, its 4-token answer, 10 new tokens; all but the answer's last token cached
        assert [x["prompt_tokens"] for x in run] == [110, 124, 138]
        for before, turn in zip(run, run[1:]):
            assert turn["expected_cached_tokens"] == before["prompt_tokens"] + 4 - 1
            assert turn["cached_tokens"] >= turn["expected_cached_tokens"] >= before["prompt_tokens"]
    assert [t["prompt_tokens"] for t in data["per_turn"]] == [110, 124, 138]
    table = open(out / "results.md").read()
    assert "| turn | prompt tokens | cached tokens | TTFT s mean | TTFT s max |" in table and "| 3 | 138 | " in table


def test_shared_over_http_hits_the_servers_prefix_cache(tmp_path):
    out = tmp_path / "http"
    bench("shared", "--serve", "--model tiny --devices cpu --enable-prefix-caching", "--doc-len", "96",
          "--question-len", "8", "--questions", "3", "--repeats", "2", "--output-dir", str(out))
    data = check_shared(str(out), 3, 2)
    assert data["url"] and data["server"]["id"] and data["label"] == "burst, 1 device(s)"
    assert all(x["cached_tokens"] >= 96 for run in data["runs"] for x in run[1:])
    # multi-turn: the answers come back as token ids (logprobs), so the next turn extends the cached one
    bench("shared", "--serve", "--model tiny --devices cpu --enable-prefix-caching", "--turns", "3", "--doc-len", "40",
          "--question-len", "6", "--output-len", "5", "--repeats", "1", "--output-dir", str(tmp_path / "turns"))
    data = check_shared(str(tmp_path / "turns"), 3, 1)
    run = data["runs"][0]
    assert [x["prompt_tokens"] for x in run] == [46, 57, 68]
    assert run[1]["cached_tokens"] >= 46 + 5 - 1 and run[2]["cached_tokens"] >= 57 + 5 - 1


def check_documents(out_dir, documents: int, rounds: int) -> dict:
    """Many-documents mode's results: each document cold once, then a question per document each round; the
    summary's counts and means by source are the records'."""
    data = json.load(open(os.path.join(out_dir, "results.json")))
    assert data["kind"] == "documents" and not data["error"]
    run = data["runs"][0]
    assert [(x["round"], x["document"]) for x in run] == [(r, d) for r in range(rounds + 1)
                                                         for d in range(1, documents + 1)]
    assert all(x["cached_tokens"] == 0 for x in run[:documents]) and not any(x["warm"] for x in run[:documents])
    s = data["summary"]
    assert s["cold"]["count"] == documents and sum(s[k]["count"] for k in SOURCES) == documents * rounds
    for name in SOURCES:
        group = [x["ttft_ms"] for x in run[documents:] if source(x) == name]
        if group:
            assert s[name]["mean_ttft_ms"] == pytest.approx(statistics.fmean(group))
    table = open(os.path.join(out_dir, "results.md")).read()
    assert "| prefix from | requests | TTFT s mean | p50 | p99 | max |" in table
    assert f"| cold | {documents} | " in table
    return data


def test_shared_many_documents_offline_reports_ttft_by_where_the_prefix_came_from(tmp_path):
    """Five 200-token documents in a pool of 512 tokens with a host tier: each round's questions find their
    document in the host tier (the pool holds two), and the table says so."""
    bench("shared", "--offline", "--model", "tiny", "--devices", "cpu", "--doc-len", "200", "--question-len", "16",
          "--documents", "5", "--rounds", "2", "--repeats", "1", "--warmup", "0", "--kv-cache-tokens", "512",
          "--kv-offload-gb", "0.02", "--output-dir", str(tmp_path / "docs"))
    data = check_documents(str(tmp_path / "docs"), 5, 2)
    s = data["summary"]
    assert s["host"]["count"] == 10 and s["none"]["count"] == 0, s
    # the document, and a token more where a question's first token is the first question's (1 in the vocabulary)
    assert all(x["host_cached_tokens"] in (200, 201) for x in data["runs"][0][5:])
    with open(tmp_path / "docs" / "results.csv") as f:
        assert all(r["host_cached_tokens"] in ("200", "201") for r in list(csv.DictReader(f))[5:])


def test_shared_many_documents_over_http_counts_host_hits(tmp_path):
    bench("shared", "--serve", "--model tiny --devices cpu --kv-cache-tokens 512 --kv-offload-gb 0.02",
          "--doc-len", "200", "--question-len", "16", "--documents", "4", "--rounds", "1", "--repeats", "1",
          "--warmup", "0", "--output-dir", str(tmp_path / "http"))
    data = check_documents(str(tmp_path / "http"), 4, 1)
    assert data["summary"]["host"]["count"] == 4, data["summary"]


def test_shared_over_http_warns_without_a_prefix_cache(tmp_path):
    """A server run with --no-enable-prefix-caching: every warm request reports 0 cached tokens, loudly."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "burstserve.server.cli", "bench", "shared", "--serve",
                           "--model tiny --devices cpu --no-enable-prefix-caching", "--doc-len", "48", "--question-len", "4", "--repeats", "1",
                           "--warmup", "0", "--turns", "2", "--output-len", "3", "--output-dir", str(tmp_path / "no")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NO cache hit" in proc.stderr and "--enable-prefix-caching" in proc.stderr
    data = json.load(open(tmp_path / "no" / "results.json"))
    assert data["summary"]["warm_without_cache_hit"] == 1 and len(data["warnings"]) == 1
    assert "**Warning**" in open(tmp_path / "no" / "results.md").read()


def test_shared_flags():
    import argparse
    from burstserve.clients.bench import add_parser
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    shared = lambda *a: parser.parse_args(["bench", "shared", *a])   # noqa: E731
    a = shared()
    assert (a.doc_len, a.question_len, a.questions, a.turns, a.output_len, a.repeats, a.max_num_batched_tokens) == \
        (32768, 512, 4, 0, None, 2, None)
    assert shared("--turns", "5").turns == 5
    assert (a.documents, a.rounds) == (1, 3) and shared("--documents", "12", "--rounds", "3").documents == 12
    for bad in (["--turns", "1"], ["--questions", "1"], ["--doc-len", "0"], ["--max-num-batched-tokens", "0"],
                ["--documents", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            shared(*bad)


def test_quantization_refused_before_any_file_where_it_cannot_run(tmp_path):
    """--quantization fp8 on CPU devices, and with the transformers peer: exit 2, one line, no results."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    for extra, words in ((["--devices", "cpu"], "needs CUDA GPUs with FP8 tensor cores"),
                         (["--sp-strategy", "transformers"], "--quantization is the engine's")):
        out = tmp_path / extra[-1]
        proc = subprocess.run([sys.executable, "-m", "burstserve.server.cli", "bench", "sweep", "--offline", "--quantization", "fp8",
                               "--lengths", "16", "--output-dir", str(out), *extra], capture_output=True, text=True,
                              cwd=ROOT, env=env, timeout=300)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
        assert not out.exists()


def test_torch_cp_peer_refused_where_it_cannot_run(tmp_path):
    """--sp-strategy torch-cp (PyTorch's context_parallel around transformers' model) on CPU devices, with
    tokens to decode, and with --quantization: exit 2, one line naming why, no results. (Lengths that do
    not divide by 2 x GPUs are refused too, after the device check: a GPU test's concern.)"""
    env = dict(os.environ, PYTHONPATH=ROOT)
    for extra, words in ((["--devices", "cpu", "-cp", "2"], "torch-cp needs CUDA GPUs"),
                         (["--output-len", "8"], "has no decode"),
                         (["--quantization", "fp8"], "--quantization is the engine's")):
        out = tmp_path / extra[-1]
        proc = subprocess.run([sys.executable, "-m", "burstserve.server.cli", "bench", "sweep", "--offline", "--sp-strategy",
                               "torch-cp", "--lengths", "16", "--output-dir", str(out), *extra], capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=300)
        assert proc.returncode == 2 and words in proc.stderr, (extra, proc.stderr[-2000:])
        assert not out.exists()


def test_transformers_that_cannot_hold_the_model_is_oom_at_every_length(monkeypatch):
    """A model whose weights alone exceed the device (the 70B preset on one GPU): every length's row is
    an OOM, as the tables show it, not a crash of the sweep."""
    import torch
    from burstserve.clients import hf_baseline, report

    def no_room(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.96 GiB")
    monkeypatch.setattr(hf_baseline, "build_model", no_room)
    rows = list(hf_baseline.sweep_transformers("llama3-70b", "cpu", None, [4096, 131072], 1, 0, None, _NoProgress()))
    assert [r["prompt_tokens"] for r in rows] == [4096, 131072]
    assert all(report.failure(r) == "OOM" for r in rows), rows


class _NoProgress:
    def update(self, n=1):
        pass


def test_torch_cp_peer_leaves_attention_to_is_causal_on_a_head_tail_shard():
    """A torch-cp rank's shard holds two runs of positions (head-tail balance). Given as they are,
    transformers reads the jump as packed sequences and hands SDPA a mask, which context_parallel cannot
    shard (the peer's 8K row failed so on 2 x H200); with clients.torch_cp.causal_inputs every layer gets
    no mask (SDPA's is_causal), and the shard's head rows are the whole prompt's first quarter."""
    from burstserve.clients.hf_baseline import build_model
    from burstserve.clients.torch_cp import causal_inputs
    torch.manual_seed(random.randrange(1 << 30))
    lm = build_model("tiny", torch.float32, torch.device("cpu"))
    n = 4 * random.randrange(4, 16)
    ids = torch.randint(lm.config.vocab_size, (1, n))
    head_tail = torch.cat([torch.arange(n // 4), torch.arange(3 * n // 4, n)])[None]   # rank 0 of 2
    masks = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a, kw: masks.append(kw.get("attention_mask")),
                                                      with_kwargs=True) for layer in lm.model.layers]
    try:
        with torch.no_grad():
            lm(input_ids=ids[:, head_tail[0]], position_ids=head_tail, use_cache=False)
            assert any(m is not None for m in masks)                  # transformers' packed reading
            masks.clear()
            shard = lm(**causal_inputs(ids[:, head_tail[0]], head_tail), use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    assert masks and all(m is None for m in masks)
    with torch.no_grad():      # the shard's head is the prompt's first quarter, attended as in the whole prompt
        whole = lm(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(shard[:, :n // 4], whole[:, :n // 4])


@pytest.mark.parametrize("mode", ["sweep", "load", "shared", "interference"])
def test_a_url_where_no_server_answers_is_one_line(tmp_path, mode):
    """`bench MODE --url` with nothing listening there: exit 2, one line naming the URL and what to do (not a
    transport traceback), no results written."""
    from burstserve.clients.server_process import free_port
    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "burstserve.server.cli", "bench", mode, "--url", url, "--output-dir", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"no server answers at {url}" in lines[0] and "burstserve serve" in lines[0], lines
    assert not out.exists()

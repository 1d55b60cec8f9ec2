"""`burstserve bench`: sweep, load, offline and merge write their files, with numbers from the measured requests."""
import csv
import json
import os
import statistics
import subprocess
import sys

import pytest

from clients.server_process import ROOT, RemoteServer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VLLM_KEYS = ["duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "total_token_throughput"] + [
    f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")]


def bench(*args) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "server.cli", "bench", *args], capture_output=True, text=True,
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
    bench("sweep", "--serve", "--model tiny --devices cpu:2", "--lengths", "64,300", "--repeats", "2",
          "--label", "burst-cpu2", "--output-dir", str(out))
    rows = check_sweep_outputs(str(out), [64, 300], 2, "burst-cpu2")
    assert rows[0]["strategy"] == "burst" and rows[0]["num_devices"] == 2


def test_offline_sweep_and_merge(tmp_path):
    bench("sweep", "--offline", "--model", "tiny", "--devices", "cpu:2", "--sp-strategy", "ring-rsa",
          "--lengths", "32,128", "--repeats", "2", "--label", "rsa", "--output-dir", str(tmp_path / "a"))
    check_sweep_outputs(str(tmp_path / "a"), [32, 128], 2, "rsa")
    bench("sweep", "--offline", "--model", "tiny", "--devices", "cpu:2", "--lengths", "32,128", "--repeats", "1",
          "--label", "burst", "--output-dir", str(tmp_path / "b"))
    printed = bench("merge", str(tmp_path / "a" / "results.json"), str(tmp_path / "b" / "results.json"),
                    "--output-dir", str(tmp_path / "m"))
    assert "| prompt tokens | rsa | burst |" in printed
    merged = json.load(open(tmp_path / "m" / "results.json"))["rows"]
    assert len(merged) == 4
    assert open(tmp_path / "m" / "ttft.png", "rb").read(8) == PNG_MAGIC


def test_load_mode_reports_vllm_metrics(tmp_path):
    server = RemoteServer(["--model", "tiny", "--devices", "cpu:2"])
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

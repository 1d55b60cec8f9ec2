"""docker/prometheus/prometheus.yml and docker/grafana/dashboards/burstserve.json against a live
server: `promtool check config`, `promtool check metrics` on its /metrics, every metric the
dashboard names present in /metrics, every dashboard query parsed by promtool and answered with
data by a real Prometheus scraping the server. promtool and prometheus come from Debian's
`prometheus` package; without them these tests fail in CI and skip elsewhere."""
import math
import os
import signal
import subprocess
import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from burstserve.clients.server_process import RemoteServer, free_port
from ops_helpers import (PROMETHEUS_YML, concrete, dashboard_metric_names, dashboard_targets, require_tool)

# promtool lints the exposition; the one rule burstserve breaks on purpose: its names carry a
# `burstserve:` prefix as vLLM's carry `vllm:` (dashboards written for vLLM map one to one).
# Any other lint problem (a counter without _total, a unit, a parse error) fails the test.
ACCEPTED_LINT = ("metric names should not contain ':'",)


@pytest.fixture(scope="module")
def server():
    # Two CPU workers, so the ring's exchange histograms get samples too.
    srv = RemoteServer(["--model", "tiny", "--devices", "cpu", "--context-parallel-size", "2"])
    try:
        complete(srv)
        yield srv
    finally:
        srv.stop()


def complete(srv, max_tokens: int = 8) -> dict:
    r = httpx.post(srv.url("/v1/completions"), timeout=120,
                   json={"model": "tiny", "prompt": "Hello, monitoring", "max_tokens": max_tokens,
                         "ignore_eos": True})
    r.raise_for_status()
    out = r.json()
    assert out["choices"] and out["usage"]["completion_tokens"] == max_tokens
    return out


@pytest.fixture(scope="module")
def metrics_text(server) -> str:
    r = httpx.get(server.url("/metrics"), timeout=30)
    r.raise_for_status()
    return r.text


def test_promtool_check_config():
    promtool = require_tool("promtool", "prometheus")
    out = subprocess.run([promtool, "check", "config", PROMETHEUS_YML], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_prometheus_config_scrapes_every_5s():
    with open(PROMETHEUS_YML) as f:
        cfg = yaml.safe_load(f)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    job = jobs["burstserve"]
    assert job.get("scrape_interval", cfg["global"]["scrape_interval"]) == "5s"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["burstserve:8000"]   # the compose service and its port


def test_promtool_check_metrics_on_live_metrics(metrics_text):
    promtool = require_tool("promtool", "prometheus")
    out = subprocess.run([promtool, "check", "metrics"], input=metrics_text, capture_output=True, text=True,
                         timeout=60)
    report = (out.stdout + out.stderr).strip()
    # 0: clean; 3: lint problems only (1 would be an exposition that does not parse).
    assert out.returncode in (0, 3), f"promtool check metrics exited {out.returncode}:\n{report}"
    problems = [line for line in report.splitlines() if line.strip()]
    unexpected = [p for p in problems if not p.endswith(ACCEPTED_LINT)]
    assert not unexpected, "promtool check metrics:\n" + "\n".join(unexpected)
    assert (out.returncode == 3) == bool(problems), report


def test_live_metrics_have_samples_of_every_family(metrics_text):
    families = {f.name: f for f in text_string_to_metric_families(metrics_text)}
    for name in ["time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "ring_exchange_seconds", "ring_exchange_exposed_seconds", "ring_exchange_hidden_fraction",
                 "prompt_tokens", "generation_tokens", "kv_cache_usage_perc"]:
        assert families[f"burstserve:{name}"].samples, name
    workers = {s.labels["worker"] for s in families["burstserve:kv_cache_usage_perc"].samples}
    assert workers == {"0", "1"}


def test_every_dashboard_metric_is_in_live_metrics(metrics_text):
    """A metric renamed in server/metrics.py, or misspelt in the dashboard, fails here."""
    exposed = {s.name for f in text_string_to_metric_families(metrics_text) for s in f.samples}
    used = dashboard_metric_names()
    assert len(used) >= 10, used
    missing = sorted(used - exposed)
    assert not missing, f"the dashboard queries metrics /metrics does not have: {missing}; it has {sorted(exposed)}"


def test_dashboard_covers_the_issue():
    exprs = " ".join(e for _, e in dashboard_targets())
    for needed in ["histogram_quantile(0.5, sum by (le) (rate(burstserve:time_to_first_token_seconds_bucket",
                   "histogram_quantile(0.99, sum by (le) (rate(burstserve:time_to_first_token_seconds_bucket",
                   "burstserve:time_per_output_token_seconds", "rate(burstserve:prompt_tokens_total",
                   "rate(burstserve:generation_tokens_total", "burstserve:num_requests_running",
                   "burstserve:num_requests_waiting", "burstserve:kv_cache_usage_perc",
                   "burstserve:ring_exchange_exposed_seconds", "burstserve:ring_exchange_hidden_fraction",
                   "burstserve:ring_exchange_seconds_sum"]:
        assert needed in exprs, needed


def test_dashboard_queries_parse(tmp_path):
    """Every query (Grafana's variables filled in) as a recording rule: promtool check rules parses them."""
    promtool = require_tool("promtool", "prometheus")
    rules = [{"record": f"dashboard:query_{i}", "expr": concrete(expr)}
             for i, (_, expr) in enumerate(dashboard_targets())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, sort_keys=False))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture
def prometheus(server, tmp_path):
    """A real Prometheus (Debian's) scraping the live server every second; yields its base URL."""
    binary = require_tool("prometheus", "prometheus")
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "scrape_configs": [{"job_name": "burstserve", "scrape_interval": "1s", "scrape_timeout": "1s",
                               "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, f"prometheus exited {proc.returncode}: {proc.stdout.read().decode()}"
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "prometheus not ready in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def query(url: str, expr: str) -> list:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def test_dashboard_queries_return_data_from_prometheus(server, prometheus):
    """Each panel's queries, evaluated by Prometheus on what it scraped from the live server, give
    series; the latency quantiles and means give numbers (requests landed between two scrapes)."""
    deadline = time.time() + 60
    while not query(prometheus, 'up{job="burstserve"} == 1'):
        assert time.time() < deadline, "prometheus never scraped the server"
        time.sleep(0.5)
    for _ in range(2):
        complete(server)
    time.sleep(2.5)                          # two scrapes after the requests
    pending = dict((f"{title}: {expr}", concrete(expr)) for title, expr in dashboard_targets())
    finite_needed = {k for k in pending if "time_to_first_token" in k or "time_per_output_token" in k}
    last = {}
    deadline = time.time() + 30
    while pending and time.time() < deadline:
        for key, expr in list(pending.items()):
            result = query(prometheus, expr)
            last[key] = result
            values = [float(s["value"][1]) for s in result]
            if values and (key not in finite_needed or any(math.isfinite(v) for v in values)):
                del pending[key]
        time.sleep(1)
    assert not pending, "queries without data: " + "; ".join(f"{k} -> {last.get(k)}" for k in pending)

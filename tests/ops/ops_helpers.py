"""Shared by tests/ops: the repository's docker/ files, the dashboard's PromQL, and external tools
(promtool, prometheus, docker-compose) that CI installs (scripts/test.sh) and a laptop may lack."""
import json
import os
import re
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKER = os.path.join(ROOT, "docker")
PROMETHEUS_YML = os.path.join(DOCKER, "prometheus", "prometheus.yml")
DASHBOARD = os.path.join(DOCKER, "grafana", "dashboards", "burstserve.json")
COMPOSE = os.path.join(DOCKER, "compose.yaml")

METRIC_NAME = re.compile(r"\bburstserve:[a-zA-Z_][a-zA-Z0-9_:]*")
# Grafana's variables, replaced by what Grafana would put there, so Prometheus can evaluate the query.
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$model_name": ".*"}


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(name: str, debian_package: str) -> str:
    """The tool's path; without it the test fails in CI (CI=true) and is skipped elsewhere."""
    path = shutil.which(name)
    if path:
        return path
    msg = (f"`{name}` is not installed: `apt-get install --no-install-recommends {debian_package}` "
           f"(Debian; scripts/test.sh does it)")
    if in_ci():
        pytest.fail(msg + " -- required when CI=true")
    pytest.skip(msg)


def dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every query of every panel."""
    out = []
    for panel in dashboard()["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"]))
    return out


def concrete(expr: str) -> str:
    """The expression with Grafana's variables filled in."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
    return expr


def dashboard_metric_names() -> set[str]:
    names = set()
    for _, expr in dashboard_targets():
        names.update(METRIC_NAME.findall(expr))
    for var in dashboard()["templating"]["list"]:
        if var.get("type") == "query":
            names.update(METRIC_NAME.findall(var["definition"]))
    return names

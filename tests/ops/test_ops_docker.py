"""docker/: the compose file (PyYAML structure, and `docker compose config` / Debian's
`docker-compose config`), the Grafana provisioning and dashboard, the Dockerfile's build arguments,
and the shell scripts' syntax. The image itself is built and run by scripts/docker_smoke.sh
(scripts/test.sh runs it beside pytest)."""
import os
import re
import shutil
import subprocess

import pytest
import yaml

from ops_helpers import COMPOSE, DOCKER, ROOT, dashboard, require_tool


def load(path):
    with open(path) as f:
        return yaml.safe_load(f)


def compose_command() -> list[str]:
    """`docker compose` (the v2 plugin) when present, else Debian's `docker-compose` (v1)."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return [require_tool("docker-compose", "docker-compose")]


def test_compose_config_validates():
    cmd = compose_command() + ["-f", COMPOSE, "config", "-q"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, f"{' '.join(cmd)}:\n{out.stdout}{out.stderr}"


def _mounts(service: dict) -> dict:
    """container path -> host path (relative host paths resolved against docker/)."""
    out = {}
    for v in service.get("volumes", []):
        host, container = v.split(":")[:2]
        if host.startswith("."):
            host = os.path.normpath(os.path.join(DOCKER, host))
        out[container] = host
    return out


def test_compose_structure():
    c = load(COMPOSE)
    assert set(c["services"]) == {"burstserve", "prometheus", "grafana"}
    bs, prom, graf = (c["services"][k] for k in ("burstserve", "prometheus", "grafana"))
    assert os.path.normpath(os.path.join(DOCKER, bs["build"]["context"])) == ROOT
    assert bs["build"]["dockerfile"] == "docker/Dockerfile"
    devices = bs["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "127.0.0.1:8000:8000" in bs["ports"]
    assert "--port 8000" in " ".join(bs["entrypoint"]) and "--host 0.0.0.0" in " ".join(bs["entrypoint"])

    prom_mounts = _mounts(prom)
    assert prom_mounts["/etc/prometheus/prometheus.yml"] == os.path.join(DOCKER, "prometheus", "prometheus.yml")
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    graf_mounts = _mounts(graf)
    assert graf_mounts["/etc/grafana/provisioning"] == os.path.join(DOCKER, "grafana", "provisioning")
    for host in list(prom_mounts.values()) + list(graf_mounts.values()):
        if host.startswith("/"):
            assert os.path.exists(host), host

    # Grafana: the provisioned dashboard folder is the mounted one, the datasource is the prometheus service.
    provider = load(os.path.join(DOCKER, "grafana", "provisioning", "dashboards", "burstserve.yml"))["providers"][0]
    dash_dir = provider["options"]["path"]
    assert graf_mounts[dash_dir] == os.path.join(DOCKER, "grafana", "dashboards")
    assert graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dash_dir + "/burstserve.json"
    ds = load(os.path.join(DOCKER, "grafana", "provisioning", "datasources", "prometheus.yml"))["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in prom["ports"]


def test_dashboard_is_well_formed():
    d = dashboard()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]


def test_dockerfile_defaults_to_a_cuda_pytorch_image():
    with open(os.path.join(DOCKER, "Dockerfile")) as f:
        text = f.read()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert base and base.group(1).startswith("pytorch/pytorch:") and "cuda" in base.group(1)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(r'^ARG PIP_EXTRA=""$', text, re.M)          # users get nothing extra
    assert os.path.isfile(os.path.join(DOCKER, "wheels", "README.md"))   # COPY docker/wheels/ needs the folder
    # Nothing the Dockerfile copies is left out of the build context.
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        ignored = {line.strip().rstrip("/") for line in f if line.strip() and not line.startswith("#")}
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert src.rstrip("/").split("/")[0] not in ignored, src
            assert os.path.exists(os.path.join(ROOT, src)), src


@pytest.mark.parametrize("script", ["scripts/docker_smoke.sh", "scripts/test.sh", ".ci/run"])
def test_shell_scripts_parse(script):
    out = subprocess.run(["bash", "-n", os.path.join(ROOT, script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr

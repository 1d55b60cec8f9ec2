#!/usr/bin/env bash
# Builds docker/Dockerfile and gets a completion from the running container, on a machine that
# reaches no image registry: the base image is made here (debootstrap of a minimal Debian bookworm
# with python3 3.11 from Debian's packages and this machine's CA bundle, `docker import`) and
# passed as BASE_IMAGE; torch is the CPU wheel this machine already has (passed through
# PIP_EXTRA, with constraints.txt's versions for the rest), so no CUDA package is downloaded. Build and run use --network host: the server
# listens on 127.0.0.1 and nothing goes through Docker's bridge.
#
#   bash scripts/docker_smoke.sh          # as root; installs docker.io and debootstrap if missing
#
# Starts dockerd if none answers (and stops it again at the end), keeps the base image between
# runs (tag $SMOKE_BASE_TAG, remade when this machine's CA bundle changes), removes its container
# and the wheel it linked into docker/wheels/ even on failure, and prints the seconds of each phase.
# Environment: TORCH_WHEEL (the CPU torch wheel; default: found in pip's find-links or /opt/wheels),
# DEBIAN_MIRROR, SMOKE_WORK (scratch folder), SMOKE_BASE_TAG, SMOKE_IMAGE_TAG, SMOKE_NEED_FREE_GIB (6: the
# disk space below which it stops before building, naming the shortage).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export DEBIAN_FRONTEND=noninteractive
export DOCKER_BUILDKIT=0      # the classic builder: Debian's docker.io has no buildx; it honours --network host

TORCH_VERSION=2.13.0
PY_TAG=cp311                  # Debian bookworm's python3 is 3.11: the wheel must be built for it
BASE_TAG=${SMOKE_BASE_TAG:-burstserve-smoke-base:bookworm-py311}
IMAGE_TAG=${SMOKE_IMAGE_TAG:-burstserve:smoke}
WORK=${SMOKE_WORK:-/var/tmp/burstserve-smoke}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
NEED_FREE_GIB=${SMOKE_NEED_FREE_GIB:-6}
CONTAINER=burstserve-smoke-$$
WHEEL_LINK=""
CONSTRAINTS_COPY=""
DOCKERD_PID=""
OK=0
PHASES=()
T_START=$EPOCHREALTIME
T_PHASE=$EPOCHREALTIME

log() { echo "[docker-smoke] $*"; }
die() { echo "[docker-smoke] FAILED: $*" >&2; exit 1; }
since() { python3 -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.2f}')" "$EPOCHREALTIME" "$1"; }
phase() { T_PHASE=$EPOCHREALTIME; log "$1 ..."; }
done_phase() { local s; s=$(since "$T_PHASE"); PHASES+=("$(printf '%-26s %8s s' "$1" "$s")"); log "$1: $s s"; }

cleanup() {
    local rc=$?
    set +e
    if [ -n "$(docker ps -aq --filter "name=^${CONTAINER}$" 2>/dev/null)" ]; then
        if [ "$OK" != 1 ]; then
            log "container log (last 40 lines):"; docker logs --tail 40 "$CONTAINER" 2>&1 | sed 's/^/    /'
        fi
        docker rm -f "$CONTAINER" >/dev/null 2>&1
    fi
    [ -n "$WHEEL_LINK" ] && rm -f "$WHEEL_LINK"
    [ -n "$CONSTRAINTS_COPY" ] && rm -f "$CONSTRAINTS_COPY"
    rm -rf "$WORK/rootfs"
    if [ -n "$DOCKERD_PID" ]; then
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    fi
    log "seconds per phase:"
    for p in "${PHASES[@]}"; do log "  $p"; done
    log "  $(printf '%-26s %8s s' 'whole smoke' "$(since "$T_START")")"
    if [ "$rc" = 0 ] && [ "$OK" = 1 ]; then log "PASSED"; else log "FAILED (exit $rc)"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ "$(id -u)" = 0 ] || die "run as root (it installs packages, starts dockerd and runs debootstrap)"
mkdir -p "$WORK"

# --- tools ------------------------------------------------------------------------------------
phase "tools"
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v curl >/dev/null || missing+=(curl)
if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    timeout 300 apt-get update -q >/dev/null
    timeout 600 apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi
command -v docker >/dev/null || die "no docker client after installing docker.io"
done_phase "tools"

# --- Docker engine ----------------------------------------------------------------------------
phase "dockerd"
if ! timeout 20 docker info >/dev/null 2>&1; then
    log "no Docker engine answers: starting dockerd (log: $WORK/dockerd.log)"
    # No bridge and no iptables rules: build and run use the host's network only.
    dockerd --bridge=none --iptables=false >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 120); do
        timeout 5 docker info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 0.5
    done
    if ! timeout 20 docker info >/dev/null 2>&1; then
        echo "[docker-smoke] dockerd did not start; the end of its log ($WORK/dockerd.log):" >&2
        tail -n 25 "$WORK/dockerd.log" | sed 's/^/    /' >&2
        grep -iE 'level=(error|fatal)|failed|permission|operation not permitted' "$WORK/dockerd.log" \
            | tail -n 5 | sed 's/^/    error: /' >&2
        die "the Docker engine could not start on this machine (see the lines above)"
    fi
fi
log "engine: $(docker version --format '{{.Server.Version}}' 2>/dev/null), client: $(docker version --format '{{.Client.Version}}' 2>/dev/null)"
# The build unpacks torch, triton (xgrammar's) and the rest into a layer: about 3 GiB, with room to spare.
root_dir=$(docker info -f '{{.DockerRootDir}}' 2>/dev/null || echo /var/lib/docker)
free_kib=$(df -Pk "$root_dir" | awk 'NR == 2 {print $4}')
[ "$free_kib" -ge $((NEED_FREE_GIB * 1024 * 1024)) ] \
    || die "$((free_kib / 1024)) MiB free on the disk of $root_dir; the build needs about $NEED_FREE_GIB GiB (free some, e.g. old virtual environments or \`docker system prune\`)"
done_phase "dockerd"

# --- the CPU torch wheel ----------------------------------------------------------------------
phase "torch wheel"
wheel=${TORCH_WHEEL:-}
if [ -z "$wheel" ]; then
    dirs="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true) /opt/wheels"
    for d in $dirs; do
        d=${d#file://}
        for f in "$d"/torch-"$TORCH_VERSION"+cpu-"$PY_TAG"-"$PY_TAG"-*linux*_x86_64.whl; do
            [ -f "$f" ] && { wheel=$f; break 2; }
        done
    done
fi
[ -n "$wheel" ] && [ -f "$wheel" ] || die "no CPU torch $TORCH_VERSION wheel for $PY_TAG found (looked in pip's find-links and /opt/wheels); set TORCH_WHEEL=/path/to/torch-$TORCH_VERSION+cpu-$PY_TAG-$PY_TAG-manylinux_2_28_x86_64.whl"
case "$(basename "$wheel")" in
    torch-"$TORCH_VERSION"+cpu-"$PY_TAG"-*) ;;
    *) die "$wheel is not torch $TORCH_VERSION+cpu for $PY_TAG (Debian bookworm's python3 is 3.11)" ;;
esac
WHEEL_LINK=$ROOT/docker/wheels/$(basename "$wheel")
ln -f "$wheel" "$WHEEL_LINK" 2>/dev/null || cp "$wheel" "$WHEEL_LINK"
CONSTRAINTS_COPY=$ROOT/docker/wheels/constraints.txt      # the test environment's versions (constraints.txt)
cp constraints.txt "$CONSTRAINTS_COPY"
log "wheel: $wheel"
done_phase "torch wheel"

# --- the base image: debootstrap + docker import (cached) -------------------------------------
ca_sha=$(sha256sum "$CA_BUNDLE" | cut -c1-16)
have_sha=$(docker image inspect -f '{{index .Config.Labels "ca_sha256"}}' "$BASE_TAG" 2>/dev/null || true)
if [ "$have_sha" = "$ca_sha" ]; then
    log "base image $BASE_TAG exists (cached): no debootstrap"
else
    phase "debootstrap"
    rm -rf "$WORK/rootfs"
    if ! timeout 900 debootstrap --variant=minbase \
            --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
            bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1; then
        tail -n 20 "$WORK/debootstrap.log" | sed 's/^/    /' >&2
        die "debootstrap of bookworm from $MIRROR failed (log: $WORK/debootstrap.log)"
    fi
    done_phase "debootstrap"
    phase "docker import"
    R=$WORK/rootfs
    rm -rf "$R"/var/cache/apt/archives/*.deb "$R"/var/lib/apt/lists/*
    cp "$CA_BUNDLE" "$R/etc/ssl/certs/ca-certificates.crt"     # this machine's CAs, so pip inside reaches PyPI
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\nbreak-system-packages = true\n' >"$R/etc/pip.conf"
    rm -f "$R"/usr/lib/python3*/EXTERNALLY-MANAGED              # pip installs into the system Python, as in the PyTorch images
    timeout 300 tar -C "$R" -c . | timeout 300 docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change "LABEL ca_sha256=$ca_sha" \
        --change 'CMD ["/bin/bash"]' - "$BASE_TAG" >/dev/null
    rm -rf "$R"
    done_phase "docker import"
fi

# --- build ------------------------------------------------------------------------------------
phase "docker build"
if ! timeout 1800 docker build --network host -f docker/Dockerfile \
        --build-arg BASE_IMAGE="$BASE_TAG" \
        --build-arg PIP_EXTRA="-c /tmp/wheels/constraints.txt /tmp/wheels/$(basename "$wheel")" \
        --label org.burstserve.smoke=1 -t "$IMAGE_TAG" . >"$WORK/build.log" 2>&1; then
    tail -n 40 "$WORK/build.log" | sed 's/^/    /' >&2
    die "docker build failed (log: $WORK/build.log)"
fi
docker image prune -f --filter label=org.burstserve.smoke=1 >/dev/null 2>&1 || true   # the previous build's image
done_phase "docker build"
versions=$(timeout 120 docker run --rm --network host --entrypoint python3 "$IMAGE_TAG" -c '
import importlib.metadata as m, torch
cuda = sorted(d.metadata["Name"] for d in m.distributions() if d.metadata["Name"].lower().startswith("nvidia"))
print(torch.__version__, sum(1 for _ in m.distributions()), "nvidia:", ",".join(cuda) or "none")')
log "in the image: torch, number of distributions, CUDA packages: $versions"
case "$versions" in
    "$TORCH_VERSION+cpu "*"nvidia: none") ;;
    *) die "the image should hold torch $TORCH_VERSION+cpu and no nvidia-* package: $versions" ;;
esac

# --- run --------------------------------------------------------------------------------------
phase "docker run until healthy"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
docker run -d --name "$CONTAINER" --network host "$IMAGE_TAG" \
    serve --model tiny --devices cpu --host 127.0.0.1 --port "$PORT" >/dev/null
URL=http://127.0.0.1:$PORT
deadline=$((SECONDS + 600))
until curl -fsS --max-time 2 "$URL/health" >/dev/null 2>&1; do
    [ "$(docker inspect -f '{{.State.Running}}' "$CONTAINER")" = true ] \
        || die "the container exited with $(docker inspect -f '{{.State.ExitCode}}' "$CONTAINER") before /health answered"
    [ $SECONDS -lt $deadline ] || die "/health did not answer within 600 s"
    sleep 0.5
done
done_phase "docker run until healthy"

phase "first completion"
answer=$(curl -fsS --max-time 300 "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "tiny", "prompt": "Hello from the container", "max_tokens": 8, "temperature": 0}') \
    || die "POST /v1/completions failed"
done_phase "first completion"
echo "$answer" | python3 -c '
import json, sys
out = json.load(sys.stdin)
choice = out["choices"][0]
assert choice["finish_reason"] in ("length", "stop"), out
assert out["usage"]["completion_tokens"] >= 1, out
print("[docker-smoke] completion:", json.dumps(out)[:300])' || die "the completion has no choices: $answer"
metrics=$(curl -fsS --max-time 30 "$URL/metrics") || die "GET /metrics failed"
grep -q '^burstserve:time_to_first_token_seconds_count' <<<"$metrics" || die "/metrics has no TTFT samples"

phase "stop container"
timeout 60 docker stop -t 30 "$CONTAINER" >/dev/null
docker rm "$CONTAINER" >/dev/null
done_phase "stop container"
OK=1

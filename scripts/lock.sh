#!/usr/bin/env bash
# Refreshes constraints.txt, the versions the test environment installs (scripts/test.sh, so CI, and
# the Docker smoke): every package that `pip install torch==2.13.0 -e '.[test]'` pulls, resolved anew
# in a throw-away virtual environment, at the newest releases pyproject.toml allows. torch is left out
# (the commands name it exactly, and pip refuses to constrain a wheel given by path) and so is
# burstserve itself. After refreshing: `bash scripts/test.sh` in a fresh clone, then commit both.
#
#   bash scripts/lock.sh            # rewrites constraints.txt; prints what changed
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q torch==2.13.0 -e '.[test]'
{
    sed -n '/^#/p' constraints.txt 2>/dev/null | sed -n '1,/^# ---$/p' | grep . || true
    "$work/venv/bin/python" -c 'import sys; print(f"# resolved for Python {sys.version.split()[0]}")'
    "$work/venv/bin/python" -m pip freeze --exclude-editable | grep -viE '^(torch|burstserve)(==| @)' | LC_ALL=C sort -f
} >"$work/constraints.txt"
diff -u constraints.txt "$work/constraints.txt" || true
mv "$work/constraints.txt" constraints.txt

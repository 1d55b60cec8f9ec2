#!/usr/bin/env bash
# flash-attn-4 in three device calls instead of two, for a working tree too large to travel beside .fa4b
# (64 MiB a call: tree + .fa4b's 52.4 MiB passed it at a tree of about 10 MiB). Run once, after
# ../shared/gpu/fa4-prepare.sh, from the project root: .fa4b's half of the compiler wheel is cut again,
# its first 30 MB into .fa4c/ (git-ignored here), and .fa4b/install.sh joins every part in name order.
# The calls (scripts/README.md, "Device calls"): [".fa4a", ".whl"], then [".fa4c"], then [".fa4b"], each
# within ~30 s of the one before; scripts/gpu.sh's header keeps .fa4a's and .fa4c's parts in /tmp/fa4.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -f .fa4b/part.ab ] || { echo ".fa4b/part.ab not there: run ../shared/gpu/fa4-prepare.sh first (or already split)" >&2; exit 1; }
mkdir -p .fa4c
head -c 30000000 .fa4b/part.ab > .fa4c/part.ab
tail -c +30000001 .fa4b/part.ab > .fa4b/part.ac
rm .fa4b/part.ab
sed -i 's|cat /tmp/fa4/part.aa "$here"/part.ab\*|cat /tmp/fa4/part.a* "$here"/part.a*|' .fa4b/install.sh
sed -i '/first half missing/a\  [ -f /tmp/fa4/part.ab ] || { echo "fa4: .fa4c (part.ab) missing: carry it in a call between .fa4a and .fa4b" >\&2; exit 3; }' .fa4b/install.sh
grep -q 'cat /tmp/fa4/part.a\* ' .fa4b/install.sh || { echo ".fa4b/install.sh: its join line was not found" >&2; exit 1; }
grep -qx "/.fa4c/" .git/info/exclude 2>/dev/null || echo "/.fa4c/" >> .git/info/exclude
du -sh .fa4a .fa4c .fa4b || true

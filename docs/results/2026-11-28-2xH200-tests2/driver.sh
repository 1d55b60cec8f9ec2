#!/usr/bin/env bash
# The two-GPU GPU tests by node id, in the order given, under one time limit; the whole log kept.
# Usage (under scripts/gpu.sh's header): bash driver.sh LIMIT_S NODE_ID...
limit=$1; shift
f=tests/gpu/test_gpu.py
ids=(); for t in "$@"; do ids+=("$f::$t"); done
echo "== $(date -u +%T) ${#ids[@]} tests, limit ${limit}s"
timeout "$limit" python3 -m pytest -s -p no:cacheprovider -p no:warnings --tb=short -rA --durations=0 -m gpu \
  "${ids[@]}" > "$OUT/pytest-full.log" 2>&1
echo "== rc $? at $(date -u +%T)"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|logit diff|diverge|^E " "$OUT/pytest-full.log" | grep -v -i "warn" | tail -80
gzip -k "$OUT/pytest-full.log"; rm "$OUT/pytest-full.log"

#!/usr/bin/env bash
# scripts/gpu_extend_sizes.py on one GPU, the engine's runs and the rule before (BURSTSERVE_RUNS_ONE_WAVE=1), one
# process each, then (unless SKIP_INTERFERENCE=1) `bench interference` as scripts/gpu_prefix.sh runs it, both ways;
# second of the two back-to-back device calls (see gpu_prefix.sh). CONTEXT (default 122880).
set -uo pipefail
bash .fa4b/install.sh || exit 3
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
trap pack EXIT
for one in 0 1; do
  BURSTSERVE_RUNS_ONE_WAVE=$one timeout 240 python3 scripts/gpu_extend_sizes.py "${CONTEXT:-122880}" 2>&1 \
      | grep -v -i "warn\|exe_args" | tee "$out/extend_sizes_one_wave_$one.txt"
done
if [ -z "${SKIP_INTERFERENCE:-}" ]; then
  for one in 0 1; do
    BURSTSERVE_RUNS_ONE_WAVE=$one OUT=$out/interference-one-wave-$one PARTS=interference UNCHUNKED=0 \
        SERVE_EXTRA="--log-level debug" bash scripts/gpu_prefix.sh 2>&1 | grep -v "^WARNING: Target" | tail -4
  done
fi

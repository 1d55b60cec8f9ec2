#!/usr/bin/env bash
# One GPU: scripts/gpu_chunk_profile.py (SCRIPT=gpu_mixed_profile: that one) (second of the two back-to-back device calls; see gpu_prefix.sh).
set -uo pipefail
bash .fa4b/install.sh || exit 3
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
trap pack EXIT
for ctx in ${CONTEXTS:-131072}; do
  timeout 400 python3 scripts/${SCRIPT:-gpu_chunk_profile}.py "$ctx" 2>&1 | grep -v -i "warn\|exe_args" | tee "$out/chunk_profile_$ctx.txt"
done

#!/usr/bin/env bash
# One GPU: scripts/gpu_decode_profile.py at 8K and 128K (second of the two back-to-back device calls).
set -uo pipefail
bash .fa4b/install.sh || exit 3
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
trap pack EXIT
for ctx in ${CONTEXTS:-8192 131072}; do
  timeout 200 python3 scripts/gpu_decode_profile.py "$ctx" 2>&1 | grep -v -i "warn\|exe_args" | tee "$out/profile_$ctx.txt"
done

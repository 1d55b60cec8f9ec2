#!/usr/bin/env bash
# scripts/gpu_prefill_profile.py (issue 13 item 2, the profile to the floor) on one GPU, or with CP=2 on
# nvidia-h200-x2 over two (the script's own two worker processes); second of the two back-to-back device
# calls (see gpu_prefix.sh). LENGTHS=8192,32768,131072 by default.
set -uo pipefail
bash .fa4b/install.sh || exit 3
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
trap pack EXIT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > "$out/env.txt" 2>&1
CP=${CP:-1} timeout 540 python3 scripts/gpu_prefill_profile.py "${LENGTHS:-8192,32768,131072}" 2>&1 | grep -v -i "warn\|exe_args" | tee "$out/prefill_profile.txt"
# and where a flash-attn-4 call's ~100 us of host time goes (cProfile)
[ -n "${SKIP_FA4_HOST:-}" ] || [ "${CP:-1}" != 1 ] || timeout 120 python3 scripts/gpu_fa4_host.py --cprofile 2>&1 | grep -v -i "exe_args" | tee "$out/fa4_host.txt"

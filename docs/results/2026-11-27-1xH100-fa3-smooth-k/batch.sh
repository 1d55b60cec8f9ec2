#!/usr/bin/env bash
# FA3's FP8 forward with K smoothed against flash-attn-4 bf16 (scripts/gpu_fa3_smooth_k.py).
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
out=${OUT:-.}
{ date -u; nvidia-smi -L; } > "$out/env.txt"
timeout 500 python3 scripts/gpu_fa3_smooth_k.py 8192x8192 32768x32768 65536x65536 8192x131072 2>&1 \
    | grep -v -i "warn\|exe_args" | tee "$out/fa3_smooth_k.md"

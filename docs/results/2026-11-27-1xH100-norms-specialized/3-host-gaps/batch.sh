#!/usr/bin/env bash
# Call C: a prefill's host-side gaps at 8K, FP8 pages + linears and bf16.
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
out=${OUT:-.}
{ date -u; nvidia-smi -L; } > "$out/env.txt"
KV=fp8 QUANT=fp8 timeout 200 python3 scripts/gpu_prefill_gaps.py 8192 16 2>&1 | grep -v -i "warn\|exe_args\|USDT" | tee "$out/gaps_fp8.md"
timeout 200 python3 scripts/gpu_prefill_gaps.py 8192 8 2>&1 | grep -v -i "warn\|exe_args\|USDT" | tee "$out/gaps_bf16.md"

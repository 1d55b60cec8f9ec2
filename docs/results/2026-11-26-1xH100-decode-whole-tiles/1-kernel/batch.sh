#!/usr/bin/env bash
# Device call 2 of 3 (after `bash scripts/gpu.sh install` twice): the FP8 decode kernel with whole tiles
# unmasked (its GPU tests, then the kernel at five launches beside the loop before it, `kt_ahead`, and its
# no-select ablation), at 1 x 128K, 16 x 8K and 1 x 1M.
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
out=${OUT:-.}
{ date -u; nvidia-smi -L; } > "$out/env.txt"
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -p no:warnings --tb=short -m gpu \
    tests/gpu/test_kernels_gpu.py -k "fp8_paged_decode" 2>&1 | grep -v -i "warn\|exe_args" | tail -15 | tee "$out/tests.log"
OUT=$out timeout 400 env VARIANTS=kernel,kt_ahead,kt_nosel SETTINGS="2,3,64,4 2,2,64,4 2,3,64,3 1,3,64,8 4,3,128,2" \
    python3 scripts/gpu_fp8_decode_variants.py 1x131072 16x8192 1x1048576 2>&1 | grep -v -i "warn\|exe_args" \
    | tee "$out/variants.txt"

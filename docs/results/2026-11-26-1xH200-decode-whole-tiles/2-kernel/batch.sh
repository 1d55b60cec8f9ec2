#!/usr/bin/env bash
# H200 call 3: the FP8 decode kernel's GPU tests; the kernel (whole tiles unmasked, base-2 softmax) at five
# launches beside the loop before it (kt_ahead), the loads alone and kt_ahead's ablations; stages 2 against 3.
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
out=${OUT:-.}
{ date -u; nvidia-smi -L; } > "$out/env.txt"
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider -p no:warnings --tb=short -m gpu \
    tests/gpu/test_kernels_gpu.py -k "fp8_paged_decode" 2>&1 | grep -v -i "warn\|exe_args" | tail -5 | tee "$out/tests.log"
OUT=$out timeout 330 env VARIANTS=kernel,loads,kt_ahead,kt_nosel,kt_noexp,kt_noreduce \
    SETTINGS="2,3,64,4 2,2,64,4 2,3,64,3 1,3,64,8 2,3,32,8" \
    python3 scripts/gpu_fp8_decode_variants.py 1x131072 16x8192 1x1048576 2>&1 | grep -v -i "warn\|exe_args" \
    | tee "$out/variants.txt"
OUT=$out timeout 100 env OPTIONS='{"as is": {}, "stages 2": {"num_stages": 2}}' python3 scripts/gpu_fp8_decode_ab.py \
    2>&1 | grep -v -i "warn\|exe_args" | tee "$out/ab.txt"
(cd "$out" && tar czf results.tgz --exclude=results.tgz . && find . -type f ! -name results.tgz -delete)

#!/usr/bin/env bash
# One device call (after `bash scripts/gpu.sh install` twice): the few-rows FP8 GEMM's GPU test, its table
# against cuBLAS (scripts/gpu_fp8_gemm.py), a decode step's profile with FP8 linears and pages, then the
# engine's decode at 1 x 128K and 16 x 8K: bf16 pages, FP8 pages, FP8 pages + FP8 linears. Results in $OUT.
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
out=${OUT:-.}
{ date -u; nvidia-smi -L; git log -1 --format="commit %h" 2>/dev/null; } > "$out/env.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short -m gpu tests/gpu/test_kernels_gpu.py \
    -k "few_rows" 2>&1 | tail -40 | tee "$out/tests.log"
OUT=$out timeout 150 python3 scripts/gpu_fp8_gemm.py ${GEMM_ROWS:-1 16} 2>&1 | grep -v -i warn | tee "$out/fp8_gemm.txt"
KV=fp8 QUANT=fp8 timeout 100 python3 scripts/gpu_decode_profile.py 131072 2>&1 | grep -v -i "warn\|exe_args" | head -14 \
    | tee "$out/profile_fp8_fp8.txt"
for cfg in ${CONFIGS:-"fp8 fp8" "fp8 none" "auto none"}; do
  set -- $cfg
  for shape in "131072 1" "8192 16"; do
    set -- $cfg $shape
    n=kv$1-q$2-$3x$4; s=$SECONDS
    timeout 100 python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp 1 --output-len 128 \
        --repeats 1 --warmup 1 --lengths "$3" --batch "$4" --kv-cache-dtype "$1" -q "$2" --label "$n" \
        --output-dir "$out/$n" > "$out/$n.log" 2>&1
    echo "$n rc=$? $((SECONDS - s)) s"; grep "^| $n" "$out/$n.log" | tail -1
  done
done

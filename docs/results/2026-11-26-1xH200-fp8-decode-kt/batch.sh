#!/usr/bin/env bash
# One device call (after `bash scripts/gpu.sh install` twice): the GPU tests of the FP8 decode kernel (scores as
# K @ Q^T), the FP8 prefill kernel, the FP8 row kernels and the engine's FP8 path, then the engine's decode at
# 1 x 128K and 16 x 8K: FP8 pages + FP8 linears against bf16 pages, in the same call. Results in $OUT/results.tgz.
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
out=${OUT:-.}
{ date -u; nvidia-smi -L; git log -1 --format="commit %h" 2>/dev/null; } > "$out/env.txt"
timeout "${TEST_LIMIT:-200}" python3 -m pytest -q -rs -p no:cacheprovider -p no:warnings --tb=short -m gpu \
    tests/gpu/test_kernels_gpu.py tests/gpu/test_gpu.py \
    -k "fp8_paged_decode or fp8_prefill_kernel or fp8_rows_made or few_rows" 2>&1 | grep -v -i "warn\|exe_args" \
    | tail -30 | tee "$out/tests.log"
for cfg in ${CONFIGS:-"fp8 fp8" "auto none"}; do
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
(cd "$out" && tar czf results.tgz --exclude=results.tgz .)

#!/usr/bin/env bash
# A prefill's kernels at 8K (and 32K), bf16 against FP8 pages + FP8 linears, then TTFT 8K in the engine (3 repeats).
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
out=${OUT:-.}
{ date -u; nvidia-smi -L; } > "$out/env.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short -m gpu tests/gpu/test_kernels_gpu.py \
    tests/gpu/test_gpu.py -k "fused_kernels or fp8_kv_round or gather_kernel or fp8_rows_made or fp8_paged_decode" 2>&1 \
    | grep -v -i "warn\|exe_args" | tail -8 | tee "$out/tests.log"
timeout 150 python3 scripts/gpu_prefill_profile.py 8192 2>&1 | grep -v -i "warn\|exe_args" > "$out/profile_bf16.md"
KV=fp8 QUANT=fp8 timeout 150 python3 scripts/gpu_prefill_profile.py 8192 2>&1 | grep -v -i "warn\|exe_args" \
    > "$out/profile_fp8.md"
for q in "fp8 fp8" "auto none"; do
  set -- $q; n=kv$1-q$2-8192
  timeout 100 python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp 1 --output-len 8 \
      --repeats 3 --warmup 1 --lengths 8192 --kv-cache-dtype "$1" -q "$2" --label "$n" > "$out/$n.log" 2>&1
  grep "^| $n" "$out/$n.log" | tail -1
done
head -8 "$out/profile_bf16.md" | tail -2; head -8 "$out/profile_fp8.md" | tail -2; grep -A12 "top kernels" "$out/profile_fp8.md"

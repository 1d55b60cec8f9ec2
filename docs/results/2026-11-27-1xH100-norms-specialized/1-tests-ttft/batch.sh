#!/usr/bin/env bash
# Call A: the row kernels' GPU tests (the norms now specialized), the 8K FP8 prefill profile, TTFT 8K
# (FP8 pages + linears 5 repeats, bf16 3 repeats) in the engine.
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
out=${OUT:-.}
{ date -u; nvidia-smi -L; git log -1 --format=%h 2>/dev/null; } > "$out/env.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short -m gpu tests/gpu/test_kernels_gpu.py \
    tests/gpu/test_gpu.py -k "fused_kernels or fp8_kv_round or gather_kernel or fp8_rows_made or fp8_paged_decode" 2>&1 \
    | grep -v -i "warn\|exe_args" | tail -8 | tee "$out/tests.log"
KV=fp8 QUANT=fp8 timeout 150 python3 scripts/gpu_prefill_profile.py 8192 2>&1 | grep -v -i "warn\|exe_args" \
    > "$out/profile_fp8.md"
for q in "fp8 fp8 5" "auto none 3"; do
  set -- $q; n=kv$1-q$2-8192
  timeout 120 python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp 1 --output-len 8 \
      --repeats "$3" --warmup 1 --lengths 8192 --kv-cache-dtype "$1" -q "$2" --label "$n" > "$out/$n.log" 2>&1
  grep "^| $n" "$out/$n.log" | tail -1
done
head -8 "$out/profile_fp8.md" | tail -2; grep -A12 "top kernels" "$out/profile_fp8.md"
(cd "$out" && tar czf results.tgz --exclude=results.tgz . )

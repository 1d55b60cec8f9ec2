#!/usr/bin/env bash
# H200 call 2 (after the install's first half): a 1,048,576-token prompt with FP8 pages and FP8 linears.
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
out=${OUT:-.}
{ date -u; nvidia-smi -L; } > "$out/env.txt"
timeout 560 python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp 1 --lengths 1048576 \
    --output-len 16 --repeats 1 --warmup 0 --kv-cache-dtype fp8 -q fp8 --label million --output-dir "$out/million" \
    > "$out/million.log" 2>&1
echo "rc=$?"; grep "^| million" "$out/million.log" | tail -2
(cd "$out" && tar czf results.tgz --exclude=results.tgz . && find . -type f ! -name results.tgz ! -name "*.log" -delete)

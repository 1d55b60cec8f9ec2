#!/usr/bin/env bash
# One device call (after `bash scripts/gpu.sh install` twice, flash-attn-4 carried): the decode kernel's launch
# settings around the chosen ones, then TPOT 1 x 128K and 16 x 8K with FP8 linears (-q fp8), bf16 pages then FP8.
set -u
out=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
{ date -u; nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline -1 2>/dev/null; } > "$out/env.txt"
timeout 200 python3 scripts/gpu_fp8_decode.py --sweep 1x131072 16x8192 2>&1 | grep -v -i "warn\|exe_args" \
    | tee "$out/sweep.txt"
for kv in auto fp8; do
  for shape in "131072 1" "8192 16"; do
    set -- $shape
    dir=$out/engine-$2x$1-kv-$kv-q-fp8; mkdir -p "$dir"
    timeout 90 python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp 1 --output-len 128 \
        --repeats 1 --warmup 1 --lengths "$1" --batch "$2" --kv-cache-dtype "$kv" -q fp8 \
        --label "kv $kv, -q fp8, $2 x $1" --output-dir "$dir" > "$dir/stdout.log" 2> "$dir/stderr.log"
    echo "$(date +%T) $2 x $1 kv $kv -q fp8: rc=$?"; grep -E "^\|" "$dir/stdout.log" | tail -1
  done
done
tar czf "$out/results.tgz" -C "$out" --exclude results.tgz .

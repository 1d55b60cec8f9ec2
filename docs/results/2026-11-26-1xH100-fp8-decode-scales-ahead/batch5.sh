#!/usr/bin/env bash
# One device call (after `bash scripts/gpu.sh install` twice, flash-attn-4 carried), the decode kernel's launch
# at 4 warps x 128-key tiles x 3 waves: its GPU tests, the kernel table against flash-attn-4 (bf16 pages), then TPOT 1 x 128K
# and decode tokens/s 16 x 8K, bf16 pages then FP8 pages, each bench in its own process.
set -u
out=${OUT:-/tmp/out}
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
{ date -u; nvidia-smi --query-gpu=name --format=csv,noheader; } > "$out/env.txt"
timeout 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings -m gpu tests/gpu/test_kernels_gpu.py -k fp8_paged_decode 2>&1 | tail -3 | tee "$out/tests.txt"
timeout 100 python3 scripts/gpu_fp8_decode.py 1x131072 16x8192 64x2048 2>&1 | grep -v -i "warn\|exe_args" \
    | tee "$out/fp8_decode.txt"
for shape in "131072 1" "8192 16"; do
  for kv in auto fp8; do
    set -- $shape
    dir=$out/engine-$2x$1-kv-$kv; mkdir -p "$dir"
    timeout 100 python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp 1 --output-len 128 \
        --repeats 1 --warmup 1 --lengths "$1" --batch "$2" --kv-cache-dtype "$kv" \
        --label "kv $kv, $2 x $1" --output-dir "$dir" > "$dir/stdout.log" 2> "$dir/stderr.log"
    echo "$(date +%T) $2 x $1 kv $kv: rc=$?"; grep -E "^\|" "$dir/stdout.log" | tail -1
  done
done
rm -f "$out"/*/*.png
tar czf "$out/results.tgz" -C "$out" --exclude results.tgz .

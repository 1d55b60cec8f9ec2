#!/usr/bin/env bash
# Call B: decode 16 x 8K in the engine, FP8 pages + FP8 linears (3 repeats) against bf16 (1), one process each.
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
out=${OUT:-.}
{ date -u; nvidia-smi -L; git log -1 --format=%h 2>/dev/null; } > "$out/env.txt"
for cfg in "fp8 fp8 3" "auto none 1"; do
  set -- $cfg
  n=kv$1-q$2-8192x16; s=$SECONDS
  timeout 250 python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp 1 --output-len 128 \
      --repeats "$3" --warmup 1 --lengths 8192 --batch 16 --kv-cache-dtype "$1" -q "$2" --label "$n" \
      --output-dir "$out/$n" > "$out/$n.log" 2>&1
  echo "$n rc=$? $((SECONDS - s)) s"; grep "^| $n" "$out/$n.log" | tail -4
done
(cd "$out" && tar czf results.tgz --exclude=results.tgz . && find . -type f ! -name results.tgz ! -name "*.log" ! -name "env.txt" -delete)

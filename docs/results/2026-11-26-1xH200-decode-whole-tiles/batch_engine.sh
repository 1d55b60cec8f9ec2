#!/usr/bin/env bash
# H200 call 4: the engine's decode at 1 x 128K (3 repeats) and 16 x 8K, FP8 pages + FP8 linears against bf16
# pages and linears, in the same call.
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
out=${OUT:-.}
{ date -u; nvidia-smi -L; } > "$out/env.txt"
for cfg in "fp8 fp8" "auto none"; do
  for shape in "131072 1 3" "8192 16 1"; do
    set -- $cfg $shape
    n=kv$1-q$2-$3x$4; s=$SECONDS
    timeout 140 python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp 1 --output-len 128 \
        --repeats "$5" --warmup 1 --lengths "$3" --batch "$4" --kv-cache-dtype "$1" -q "$2" --label "$n" \
        --output-dir "$out/$n" > "$out/$n.log" 2>&1
    echo "$n rc=$? $((SECONDS - s)) s"; grep "^| $n" "$out/$n.log" | tail -3
  done
done
(cd "$out" && tar czf results.tgz --exclude=results.tgz . && find . -type f ! -name results.tgz ! -name "*.log" -delete)

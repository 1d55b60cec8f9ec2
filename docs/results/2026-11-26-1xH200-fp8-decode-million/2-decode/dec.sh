# run on the device as `bash scripts/gpu.sh run bash /tmp/dec.sh` (written to /tmp there by the same call)
for cfg in "auto none" "fp8 none" "fp8 fp8" "auto fp8"; do set -- $cfg
 for shape in "131072 1" "8192 16"; do set -- $cfg $shape
  n=kv$1-q$2-$3x$4; s=$SECONDS
  timeout 120 python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp 1 --output-len 128 --repeats 1 --warmup 1 --lengths $3 --batch $4 --kv-cache-dtype $1 -q $2 --label "$n" --output-dir "$OUT/$n" > "$OUT/$n.log" 2>&1
  echo "$n rc=$? $((SECONDS-s))s"; grep "^| $n" "$OUT/$n.log" | tail -1
 done
done

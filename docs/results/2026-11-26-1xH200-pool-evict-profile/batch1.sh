# throwaway batch: issue 36 re-measure, capacity with empty_cache, FP8 gather bandwidth
set -x
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
K=${K:-all}
off="--offline --model llama3-8b --devices cuda -cp 1"
if [ "$K" = a ] || [ "$K" = all ]; then
  PARTS="tests gpuhit" KV=auto HOST_GIB=40 bash scripts/gpu.sh hosttier
  for g in 0 40; do
    mkdir -p $OUT/evict-$g
    timeout 200 python3 -m server.cli bench shared $off --kv-offload-gb $g --doc-len 131072 --question-len 512 --questions 4 --repeats 1 --warmup 1 --output-dir $OUT/evict-$g > $OUT/evict-$g/stdout.log 2> $OUT/evict-$g/stderr.log
    echo "evict-$g rc=$?"; grep "^|" $OUT/evict-$g/stdout.log | tail -8
  done
fi
if [ "$K" = b ] || [ "$K" = all ]; then
  timeout 120 python3 scripts/gpu_kv_capacity.py auto fp8 2>&1 | grep -v -i warn | tee $OUT/capacity.txt | grep -E "^\||in use after"
  timeout 60 python3 tmp_gather.py 2>&1 | tee $OUT/gather.txt
  for kv in auto fp8; do
    mkdir -p $OUT/ttft-$kv
    timeout 200 python3 -m server.cli bench sweep $off --lengths 8192,131072 --repeats 1 --warmup 1 --kv-cache-dtype $kv --output-dir $OUT/ttft-$kv > $OUT/ttft-$kv/stdout.log 2> $OUT/ttft-$kv/stderr.log
    echo "ttft-$kv rc=$?"; grep "^|" $OUT/ttft-$kv/stdout.log | tail -4; grep "in use after" $OUT/ttft-$kv/stderr.log | tail -1
  done
fi
cd $OUT && tar czf /tmp/b1.tgz . && rm -rf ./* && mv /tmp/b1.tgz $OUT/batch.tgz

# throwaway batch 2: MLP pieces (capacity, TTFT), FP8 decode conversion sweep, profile of extend/decode
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
off="--offline --model llama3-8b --devices cuda -cp 1"
if [ "$K" = b ]; then
  timeout 150 python3 scripts/gpu_kv_capacity.py auto fp8 > $OUT/capacity.txt 2>&1; grep -E "^\||in use after" $OUT/capacity.txt | sed 's/.*worker 0: //'
  for v in "auto none" "fp8 none" "fp8 fp8"; do set -- $v
    d=$OUT/ttft-$1-$2; mkdir -p $d
    timeout 150 python3 -m server.cli bench sweep $off --lengths 8192,131072 --repeats 1 --warmup 1 --kv-cache-dtype $1 -q $2 --output-dir $d > $OUT/ttft-$1-$2.out 2> $OUT/ttft-$1-$2.err
    echo "ttft kv=$1 q=$2 rc=$?"; grep "^|" $OUT/ttft-$1-$2.out | tail -2; grep -E "in use after|Error|error" $OUT/ttft-$1-$2.err | tail -2 | sed 's/.*worker 0: //'
  done
fi
if [ "$K" = c ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short -m gpu tests/gpu/test_kernels_gpu.py -k "fp8_paged" 2>&1 | tail -3
  timeout 200 python3 scripts/gpu_fp8_decode.py --sweep 1x131072 16x8192 2>&1 | grep -v -i warn | tee $OUT/sweep.txt
  timeout 240 python3 tmp_profile.py 131072 2>&1 | grep -v -i "warn\|USDT" | tee $OUT/profile.txt
fi
cd $OUT && tar czf /tmp/b.tgz . && rm -rf ./* && mv /tmp/b.tgz $OUT/batch-$K.tgz

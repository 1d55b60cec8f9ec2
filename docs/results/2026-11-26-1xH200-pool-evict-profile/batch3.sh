# throwaway batch 3: FP8 chunks through one flash-attn-4 call (tests, streams, GPU hit, TTFT)
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD
off="--offline --model llama3-8b --devices cuda -cp 1"
if [ "$K" = t ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short -m gpu tests/gpu/test_kernels_gpu.py tests/gpu/test_gpu.py -k "chunks_over_fp8_pages or fp8_pages_gather or fp8_kv_cache_matches or fp8_engine_on_one_gpu" 2>&1 | tail -15 | tee $OUT/tests.log
  OUT=$OUT timeout 200 python3 scripts/gpu_host_tier.py streams --kv-cache-dtype fp8 --kv-offload-gb 60 --kv-cache-tokens 262144 --documents 4 > $OUT/streams.txt 2>&1; grep -E "^question|longest|p99" $OUT/streams.txt
fi
if [ "$K" = b ]; then
  mkdir -p $OUT/gpuhit-fp8 $OUT/ttft-fp8
  timeout 150 python3 -m server.cli bench shared $off --kv-cache-dtype fp8 --kv-offload-gb 0 --doc-len 131072 --question-len 512 --questions 4 --repeats 1 --warmup 1 --output-dir $OUT/gpuhit-fp8 > $OUT/gpuhit-fp8.out 2>&1; echo "gpuhit rc=$?"; grep "^|" $OUT/gpuhit-fp8.out | tail -3
  timeout 150 python3 -m server.cli bench sweep $off --lengths 8192,131072 --repeats 1 --warmup 1 --kv-cache-dtype fp8 --output-dir $OUT/ttft-fp8 > $OUT/ttft-fp8.out 2>&1; echo "ttft rc=$?"; grep "^|" $OUT/ttft-fp8.out | tail -2
  timeout 100 python3 scripts/gpu_kv_capacity.py fp8 2>&1 | grep "^|" | tail -1
fi
cd $OUT && tar czf /tmp/b.tgz . && rm -rf ./* && mv /tmp/b.tgz $OUT/batch3-$K.tgz

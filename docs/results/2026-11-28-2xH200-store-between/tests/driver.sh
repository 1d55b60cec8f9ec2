#!/usr/bin/env bash
# pass-KV's exactness test; burst-zero's GPU tests; burst-zero against burst on llama3-8b (TTFT, TPOT)
O=$OUT
echo "== kv test $(date -u +%T)"
timeout 120 python3 -m pytest -q -s -p no:cacheprovider -p no:warnings --tb=short -m gpu tests/gpu/test_gpu.py \
  -k "chunks_and_prefix and kv" 2>&1 | grep -v -i "warn\|exe_args" | grep -E "logit diff|passed|failed|Error|assert" \
  | tail -25 | tee "$O/kv_test.log"
echo "== zero $(date -u +%T)"
timeout 170 python3 -m pytest -q -s -p no:cacheprovider -p no:warnings --tb=short -m gpu tests/gpu \
  -k "(every_strategy and burst-zero) or measures_which_prompts" 2>&1 \
  | grep -E "logit diff|passed|failed|Error|assert|slices" | tee "$O/zero_tests.log"
for s in burst-zero burst; do
  echo "== 8b $s $(date -u +%T)"
  timeout 130 python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp 2 --sp-strategy $s \
    --lengths 8192,131072 --output-len 64 --repeats 2 --warmup 1 --label "$s" --output-dir "$O/8b-$s" 2>&1 \
    | grep -v -i "warn\|exe_args" | grep "^|" 
done

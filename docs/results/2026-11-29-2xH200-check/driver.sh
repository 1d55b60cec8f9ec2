#!/usr/bin/env bash
# The GPU paths since the step became one message a turn and the plan complete (issue 52), on 2 x H200, under
# scripts/gpu.sh's header:   bash scripts/gpu.sh run bash docs/results/2026-11-29-2xH200-check/driver.sh check
# check: two lanes of one-GPU tests at once (GPU 0, GPU 1), then the two-GPU tests; each test in a pytest
#        process of its own with its own limit, so a test cut by its limit does not take the others' reports.
set -u
mode=${1:-check}
start=$SECONDS
budget=${BUDGET:-555}
f=tests/gpu/test_gpu.py

one() {   # LANE LANE_END NODE: one test, its own process, limited by the lane's end and CAP (200 s); at the
          # limit less 15 s pytest-timeout prints every thread's stack (where a hang waits)
  local lane=$1 end=$2 node=$3 t0=$SECONDS name limit
  name=$(echo "$node" | tr -c 'a-zA-Z0-9_\n' '_' | cut -c1-90)
  limit=$(( end - SECONDS )); [ "$limit" -gt "${CAP:-200}" ] && limit=${CAP:-200}
  if [ "$limit" -lt 30 ]; then echo "[$lane] $node: NOT RUN (lane out of time)"; return; fi
  CUDA_VISIBLE_DEVICES=$VISIBLE timeout "$limit" python3 -m pytest -s -p no:cacheprovider -p no:warnings --tb=short \
      -o timeout_method=thread --timeout=$((limit - 15)) -rA -m gpu "$f::$node" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$lane] $node: rc $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (TIMEOUT)')"
  grep -E "logit|diverge|identical|gaps|diff|margin|^E |PASSED|FAILED|SKIPPED|ERROR|Error" "$OUT/$name.log" \
      | grep -v -i "warn" | head -25 | sed "s/^/[$lane]   /"
  gzip -f "$OUT/$name.log"
}

lane() {   # NAME GPUS END NODE...: the nodes one after another
  local name=$1 end=$3; shift 3
  for node in "$@"; do VISIBLE=$VISIBLE one "$name" "$end" "$node"; done
}

nvidia-smi --query-gpu=index,name,clocks.sm,power.limit --format=csv
case "$mode" in
  check)
    VISIBLE=0 lane gpu0 0 $((start + 290)) \
        "test_decode_in_cuda_graphs_matches_eager_decode_and_transformers" \
        "test_small_extends_in_cuda_graphs_match_eager_and_transformers[cuda:0]" \
        "test_fp8_engine_on_one_gpu_matches_its_model_and_decodes_in_graphs" \
        "test_small_chunk_after_a_long_prefix_splits_the_prefix_and_matches_transformers" > "$OUT/lane0.txt" 2>&1 &
    VISIBLE=1 lane gpu1 1 $((start + 290)) \
        "test_async_scheduling_in_cuda_graphs_gives_the_tokens_of_sync_scheduling[cuda:0]" \
        "test_mixed_batch_in_cuda_graphs_matches_eager_and_transformers" \
        "test_chunks_and_prefix_extensions_match_transformers[cuda:0-4096-q]" \
        "test_shutdown_after_cuda_graphs_on_one_gpu_and_two[cuda:0]" \
        "test_engine_bf16_on_one_gpu_matches_transformers_with_each_backend[flash-attn]" > "$OUT/lane1.txt" 2>&1 &
    wait
    cat "$OUT/lane0.txt" "$OUT/lane1.txt"
    VISIBLE=0,1 lane two 01 $((start + budget)) \
        "test_async_scheduling_in_cuda_graphs_gives_the_tokens_of_sync_scheduling[cuda:0,1]" \
        "test_chunks_and_prefix_extensions_match_transformers[cuda:0,1-0-kv]" \
        "test_small_extends_in_cuda_graphs_match_eager_and_transformers[cuda:0,1]" \
        "test_shutdown_after_cuda_graphs_on_one_gpu_and_two[cuda:0,1]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[ring-rsa-2]" ;;
  rest)   # what check left: the small extends given time, the rest of both lanes, shutdown on two, ring-rsa-2
    CAP=280 VISIBLE=0 lane gpu0 0 $((start + 290)) \
        "test_small_extends_in_cuda_graphs_match_eager_and_transformers[cuda:0]" \
        "test_fp8_engine_on_one_gpu_matches_its_model_and_decodes_in_graphs" > "$OUT/lane0.txt" 2>&1 &
    VISIBLE=1 lane gpu1 1 $((start + 290)) \
        "test_chunks_and_prefix_extensions_match_transformers[cuda:0-4096-q]" \
        "test_shutdown_after_cuda_graphs_on_one_gpu_and_two[cuda:0]" \
        "test_small_chunk_after_a_long_prefix_splits_the_prefix_and_matches_transformers" \
        "test_engine_bf16_on_one_gpu_matches_transformers_with_each_backend[flash-attn]" > "$OUT/lane1.txt" 2>&1 &
    wait
    cat "$OUT/lane0.txt" "$OUT/lane1.txt"
    CAP=260 VISIBLE=0,1 lane two 01 $((start + budget)) \
        "test_shutdown_after_cuda_graphs_on_one_gpu_and_two[cuda:0,1]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[ring-rsa-2]" \
        "test_small_extends_in_cuda_graphs_match_eager_and_transformers[cuda:0,1]" ;;
  *) echo "usage: driver.sh check|rest" >&2; exit 2 ;;
esac
echo "driver done in $((SECONDS - start)) s"

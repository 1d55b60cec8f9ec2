#!/usr/bin/env bash
# The one-GPU tests of the one KV ledger (issue 52, 952f288 and after) on one H200, under scripts/gpu.sh's header:
#   bash scripts/gpu.sh run bash docs/results/2026-11-29-1xH200-issue52/driver.sh [NODE...]
# (NODEs given: those tests one after another, alone on the GPU)
# Three lanes at once on GPU 0, each test in a pytest process of its own with its own limit (CAP, 200 s), so a
# test cut by its limit does not take the others' reports; at the limit less 15 s pytest-timeout prints every
# thread's stack (where a hang waits).
set -u
start=$SECONDS
budget=${BUDGET:-540}
f=tests/gpu/test_gpu.py

one() {   # LANE NODE
  local lane=$1 node=$2 t0=$SECONDS name limit
  name=$(echo "$node" | tr -c 'a-zA-Z0-9_\n' '_' | cut -c1-90)
  limit=$(( start + budget - SECONDS )); [ "$limit" -gt "${CAP:-200}" ] && limit=${CAP:-200}
  if [ "$limit" -lt 30 ]; then echo "[$lane] $node: NOT RUN (lane out of time)"; return; fi
  timeout "$limit" python3 -m pytest -s -p no:cacheprovider -p no:warnings --tb=short \
      -o timeout_method=thread --timeout=$((limit - 15)) -rA -m gpu "$f::$node" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$lane] $node: rc $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (TIMEOUT)')"
  grep -E "logit|diverge|identical|gaps|diff|margin|^E |PASSED|FAILED|SKIPPED|ERROR|Error" "$OUT/$name.log" \
      | grep -v -i "warn" | head -25 | sed "s/^/[$lane]   /"
  gzip -f "$OUT/$name.log"
}

lane() {   # NAME NODE...: the nodes one after another
  local name=$1; shift
  for node in "$@"; do one "$name" "$node"; done
}

nvidia-smi --query-gpu=index,name,clocks.sm,power.limit --format=csv
export CUDA_VISIBLE_DEVICES=0
if [ $# -gt 0 ]; then lane one "$@"; echo "driver done in $((SECONDS - start)) s"; exit; fi   # NODE...: one lane
lane a "test_decode_in_cuda_graphs_matches_eager_decode_and_transformers" \
       "test_fp8_engine_on_one_gpu_matches_its_model_and_decodes_in_graphs" \
       "test_shutdown_after_cuda_graphs_on_one_gpu_and_two[cuda:0]" > "$OUT/lane_a.txt" 2>&1 &
lane b "test_small_extends_in_cuda_graphs_match_eager_and_transformers[cuda:0]" \
       "test_small_chunk_after_a_long_prefix_splits_the_prefix_and_matches_transformers" \
       "test_engine_bf16_on_one_gpu_matches_transformers_with_each_backend[flash-attn]" > "$OUT/lane_b.txt" 2>&1 &
lane c "test_async_scheduling_in_cuda_graphs_gives_the_tokens_of_sync_scheduling[cuda:0]" \
       "test_mixed_batch_in_cuda_graphs_matches_eager_and_transformers" \
       "test_chunks_and_prefix_extensions_match_transformers[cuda:0-4096-q]" > "$OUT/lane_c.txt" 2>&1 &
wait
cat "$OUT/lane_a.txt" "$OUT/lane_b.txt" "$OUT/lane_c.txt"
echo "driver done in $((SECONDS - start)) s"

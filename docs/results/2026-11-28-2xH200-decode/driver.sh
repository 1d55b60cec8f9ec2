#!/usr/bin/env bash
# Two GPUs (issues 49, 50), one device call a step, under scripts/gpu.sh's header:
#   bash scripts/gpu.sh run bash docs/results/2026-11-28-2xH200-decode/driver.sh decode|tests
# decode: a decode step's collectives alone (collectives.py: NCCL against symmetric memory in CUDA graphs), then
#         where a decode step goes at 1 x 8K on the weight slices (burst-zero) and on whole weights (burst):
#         scripts/gpu_decode_profile.py, worker 0's tables and every worker's replay by kind.
# tests:  the two-GPU GPU tests not yet run on today's engine, by node id, under one limit.
# refactor: the GPU paths the refactors since 8c776d5 touch (decode and extend CUDA graphs, async scheduling, chunks,
#         shutdown): two lanes of one-GPU tests at once (GPU 0, GPU 1), then two-GPU tests, then ring-rsa-2.
set -u
mode=$1
start=$SECONDS
left() { echo $(( ${BUDGET:-560} - (SECONDS - start) )); }
here=docs/results/2026-11-28-2xH200-decode
f=tests/gpu/test_gpu.py

tests() {   # [VISIBLE=0,1] tests NAME LIMIT NODE...: pytest on those node ids
  local name=$1 limit=$2 ids=() stop=(); shift 2
  for t in "$@"; do ids+=("$f::$t"); done
  python3 -c "import pytest_timeout" 2>/dev/null && stop=(--session-timeout $((limit - 150)))
  CUDA_VISIBLE_DEVICES=${VISIBLE:-0,1} timeout "$limit" python3 -m pytest -s -p no:cacheprovider -p no:warnings --tb=short \
      -rA --durations=0 -m gpu "${stop[@]}" "${ids[@]}" > "$OUT/$name.log" 2>&1
  echo "== $name: rc $? at $(date -u +%T)"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|logit diff|diverge|^E " "$OUT/$name.log" | grep -v -i warn | tail -40
  gzip "$OUT/$name.log"
}

profile() {   # profile SP LIMIT: the decode profile at 1 x 8K on 2 GPUs
  local sp=$1 limit=$2 t0=$SECONDS
  [ "$limit" -gt 40 ] || { echo "profile $sp: skipped (no time left)"; return; }
  CP=2 SP=$sp timeout "$limit" python3 scripts/gpu_decode_profile.py 8192 2>&1 | grep -v -i "warn\|exe_args" \
      > "$OUT/profile_$sp.txt"
  echo "== profile $sp: rc $? in $((SECONDS - t0)) s"
  cat "$OUT/profile_$sp.txt" | tail -80
}

nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv
case "$mode" in
  decode)
    timeout 120 python3 $here/collectives.py 2>&1 | grep -v -i warn | tee "$OUT/collectives.md"
    profile burst-zero 220
    profile burst "$(( $(left) > 220 ? 220 : $(left) ))" ;;
  tests)
    tests fa4 "$(left)" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[burst-zero-2]" \
        "test_fp8_kv_cache_matches_transformers_with_kv_rounded[tp]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[ulysses-2]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[tp-2]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[cqs-2]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[tp-v3-2]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[burst-nolao-2]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[ring-rsa-2]" ;;
  refactor)
    VISIBLE=0 tests one-a 300 "test_decode_in_cuda_graphs_matches_eager_decode_and_transformers" \
        "test_small_extends_in_cuda_graphs_match_eager_and_transformers[cuda:0]" \
        "test_engine_bf16_on_one_gpu_matches_transformers_with_each_backend[flash-attn]" \
        "test_fp8_engine_on_one_gpu_matches_its_model_and_decodes_in_graphs" &
    VISIBLE=1 tests one-b 300 "test_async_scheduling_in_cuda_graphs_gives_the_tokens_of_sync_scheduling[cuda:0]" \
        "test_mixed_batch_in_cuda_graphs_matches_eager_and_transformers" \
        "test_small_chunk_after_a_long_prefix_splits_the_prefix_and_matches_transformers" \
        "test_shutdown_after_cuda_graphs_on_one_gpu_and_two[cuda:0]" &
    wait
    tests two "$(left)" "test_async_scheduling_in_cuda_graphs_gives_the_tokens_of_sync_scheduling[cuda:0,1]" \
        "test_small_extends_in_cuda_graphs_match_eager_and_transformers[cuda:0,1]" \
        "test_shutdown_after_cuda_graphs_on_one_gpu_and_two[cuda:0,1]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[ring-rsa-2]" ;;
  *) echo "usage: driver.sh decode|tests|refactor" >&2; exit 2 ;;
esac

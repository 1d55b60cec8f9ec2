#!/usr/bin/env bash
# Four GPUs of one machine (issue 49, "What to build" 5), one device call a step, under scripts/gpu.sh's header:
#   bash scripts/gpu.sh run bash docs/results/2026-11-28-4xH200-scaling/driver.sh tests|table|million
# tests:   the GPU tests on 4 GPUs (the NCCL ring, default flags against transformers, burst with flash-attn-4
#          and cuDNN against fp32, pass-KV chunks and prefix extends), then two lanes of two-GPU tests not yet run
#          on today's engine (GPUs 0,1 and 2,3), all under one limit.
# table:   TTFT by GPU count on this machine, each configuration one `bench sweep --offline` process: default flags
#          on 4, the ring's merges in their own step (BURSTSERVE_RING_MERGE=early, the A/B) on 4, tp and torch-cp
#          on 4, default flags on 2, the engine on 1; one merged table.
# million: 1,048,576 tokens on 4 GPUs: default flags (chunks of 262144), one call (--no-enable-chunked-prefill),
#          tp, torch-cp, each under what is left of the call's limit.
set -u
mode=$1
start=$SECONDS
left() { echo $(( ${BUDGET:-560} - (SECONDS - start) )); }
f=tests/gpu/test_gpu.py

# tests NAME LIMIT VISIBLE NODE...: pytest on those node ids (pytest-timeout stops it between tests in time)
tests() {
  local name=$1 limit=$2 visible=$3 ids=() stop=(); shift 3
  for t in "$@"; do ids+=("$f::$t"); done
  python3 -c "import pytest_timeout" 2>/dev/null && stop=(--session-timeout $((limit - 30)))
  CUDA_VISIBLE_DEVICES=$visible timeout "$limit" python3 -m pytest -s -p no:cacheprovider -p no:warnings --tb=short \
      -rA --durations=0 -m gpu "${stop[@]}" "${ids[@]}" > "$OUT/$name.log" 2>&1
  echo "== $name: rc $? at $(date -u +%T)"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|logit diff|diverge|^E " "$OUT/$name.log" | grep -v -i warn | tail -40
  gzip "$OUT/$name.log"
}

# sweep NAME LIMIT WORKERS ARGS...: one `bench sweep --offline` on the first WORKERS GPUs
sweep() {
  local name=$1 limit=$2 workers=$3 t0=$SECONDS; shift 3
  [ "$limit" -gt 30 ] || { echo "$name: skipped (no time left)"; return; }
  mkdir -p "$OUT/$name"
  timeout "$limit" python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp "$workers" "$@" \
      --label "$name" --output-dir "$OUT/$name" > "$OUT/$name/stdout.log" 2> "$OUT/$name/stderr.log"
  echo "$(date -u +%T) $name: rc=$? in $((SECONDS - t0)) s"
  grep -E "^\|" "$OUT/$name/stdout.log" | tail -6
  grep -v -i warn "$OUT/$name/stderr.log" | grep -i -E "error|oom|out of memory|Traceback" | tail -3
  [ -f "$OUT/$name/results.json" ] && results+=("$OUT/$name/results.json")
}

merge() {
  [ ${#results[@]} = 0 ] || python3 -m server.cli bench merge "${results[@]}" --output-dir "$OUT/merged" \
      | grep -E "^\|" | tee "$OUT/merged.md"
}

nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv \
    > "$OUT/gpus-before.csv"; cat "$OUT/gpus-before.csv"
results=()
case "$mode" in
  tests)
    tests four "${BUDGET_FOUR:-320}" 0,1,2,3 "test_nccl_ring_matches_one_device[4099]" \
        "test_engine_bf16_on_several_gpus_matches_transformers[4]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[burst-4]" \
        "test_chunks_and_prefix_extensions_match_transformers[cuda:0,1,2,3-0-kv]"
    lane=$(left)
    tests two-a "$lane" 0,1 "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[burst-2]" \
        "test_fp8_kv_cache_matches_transformers_with_kv_rounded[tp]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[ulysses-2]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[tp-2]" &
    tests two-b "$lane" 2,3 "test_chunks_and_prefix_extensions_match_transformers[cuda:0,1-0-q]" \
        "test_fp8_kv_cache_matches_transformers_with_kv_rounded[burst]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[burst-zero-2]" \
        "test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32[cqs-2]" &
    wait ;;
  table)
    all=8192,32768,131072,262144
    sweep default-4 150 4 --lengths $all --repeats 1 --warmup 1
    BURSTSERVE_RING_MERGE=early sweep merge-early-4 120 4 --lengths 32768,131072,262144 --repeats 1 --warmup 1
    sweep engine-1 100 1 --lengths 8192,32768,131072 --repeats 1 --warmup 1
    sweep tp-4 "$(( $(left) > 110 ? 110 : $(left) ))" 4 --sp-strategy tp --lengths $all --repeats 1 --warmup 1
    sweep default-2 "$(( $(left) > 120 ? 120 : $(left) ))" 2 --lengths $all --repeats 1 --warmup 1
    sweep torch-cp-4 "$(left)" 4 --sp-strategy torch-cp --lengths $all --repeats 1 --warmup 1
    merge ;;
  million)
    n=1048576
    sweep default-4-million 230 4 --lengths $n --repeats 1 --warmup 0 --output-len 16
    sweep unchunked-4-million "$(( $(left) > 200 ? 200 : $(left) ))" 4 --lengths $n --repeats 1 --warmup 0 \
        --no-enable-chunked-prefill
    sweep tp-4-million "$(left)" 4 --sp-strategy tp --lengths $n --repeats 1 --warmup 0
    merge ;;
  *) echo "mode: tests | table | million" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv > "$OUT/gpus-after.csv"

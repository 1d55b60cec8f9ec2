#!/usr/bin/env bash
# The first GPU figures of a mixture of experts: the qwen3-30b-a3b preset (random weights, Qwen3-30B-A3B's shapes),
# bf16, one GPU. Run under scripts/gpu.sh's header: `bash scripts/gpu.sh run bash docs/results/2026-12-07-1xGPU-moe/driver.sh PART`.
#   engine: TTFT 8K / 32K (bench sweep --offline, default flags), then TPOT of one 8K stream (64 tokens)
#   hf:     transformers (Qwen3MoeForCausalLM, experts as its grouped_mm, sdpa) TTFT 8K / 32K, same machine
set -u
out=${OUT:-/tmp/burstserve-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > "$out/gpu.txt"
bench() {   # bench NAME LIMIT ARGS...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" python3 -m burstserve.clients.bench "$@" --output-dir "$out/$name" > "$out/$name.log" 2>&1
  echo "$(date +%T) $name: rc=$? in $((SECONDS - start)) s"
  grep -E "^\|" "$out/$name.log" | tail -6
  grep -iE "error|Traceback|out of memory" "$out/$name.log" | tail -5
}
M="--offline --model qwen3-30b-a3b --devices cuda"
case "${1:-engine}" in
  engine)
    bench engine-ttft 330 sweep $M --lengths 8192,32768 --repeats 2 --warmup 1 --label "engine, 1 GPU"
    bench engine-tpot 200 sweep $M --lengths 8192 --output-len 64 --repeats 1 --warmup 1 --label "engine, 1 GPU, 1 x 8K"
    ;;
  hf)
    bench hf-ttft 400 sweep $M --sp-strategy transformers --lengths 8192,32768 --repeats 2 --warmup 1 --label transformers
    ;;
esac

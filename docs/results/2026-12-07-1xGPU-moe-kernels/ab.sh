#!/usr/bin/env bash
# One device call, no flash-attn-4 (cuDNN prefill attention, the engine's decode without fa4): the experts' GPU tests on
# this tree, then qwen3-30b-a3b bf16 TTFT 8K and TPOT 1 x 8K (64 tokens) on this tree and on the tree before the few-row
# kernels (58af417, carried as .ab/base.tgz), one after the other on the same GPU. (16 x 8K: driver.sh.)
#   bash scripts/gpu.sh run bash docs/results/2026-12-07-1xGPU-moe-kernels/ab.sh
set -u
out=${OUT:-/tmp/burstserve-gpu}
mkdir -p "$out" /tmp/base
tar xzf .ab/base.tgz -C /tmp/base
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > "$out/gpu.txt"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py tests/engine/test_moe_fp8.py \
    -k "mixture or fp8_experts_on_a_gpu" 2>&1 \
    | tee "$out/tests.log" | grep -E "passed|failed|error|diff" | tail -8
bench() {   # bench NAME LIMIT TREE ARGS...
  local name=$1 limit=$2 tree=$3; shift 3
  local start=$SECONDS
  (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout "$limit" python3 -m burstserve.clients.bench "$@" \
      --output-dir "$out/$name") > "$out/$name.log" 2>&1
  echo "$(date +%T) $name: rc=$? in $((SECONDS - start)) s"
  grep -E "^\|" "$out/$name.log" | tail -4
  grep -iE "Traceback|out of memory|Error" "$out/$name.log" | tail -3
}
M="sweep --offline --model qwen3-30b-a3b --devices cuda --output-len 64 --repeats 1 --warmup 1"
bench this-1x8k 120 "$PWD" $M --lengths 8192 --label "this tree"
bench base-1x8k 110 /tmp/base $M --lengths 8192 --label "58af417"


#!/usr/bin/env bash
# qwen3-30b-a3b (random weights, Qwen3-30B-A3B's shapes), bf16, one GPU, with the few-row experts' kernels
# (kernels/moe_few_rows.py) and the grouped path's weights folded before down. Under scripts/gpu.sh's header:
#   bash scripts/gpu.sh run bash docs/results/2026-12-07-1xGPU-moe-kernels/driver.sh PART
#   probes: the few-row kernels against the grouped GEMMs (1-64 rows), a prefill piece stage by stage
#   pieces: a prefill piece stage by stage
#   tests:  the GPU tests of the experts (kernels and engine against transformers)
#   engine: TTFT 8K / 32K and TPOT 1 x 8K / 1 x 32K (one sweep, 64 tokens out); 16 x 8K
#   engine64: 64 x 2K
#   floor:  bare kernels and bytes (docs/results/2026-12-07-1xGPU-moe/floor.py)
#   hf:     transformers (grouped_mm experts, sdpa) TTFT 8K / 32K
set -u
out=${OUT:-/tmp/burstserve-gpu}
here=docs/results/2026-12-07-1xGPU-moe
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > "$out/gpu.txt"
bench() {   # bench NAME LIMIT ARGS...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" python3 -m burstserve.clients.bench "$@" --output-dir "$out/$name" > "$out/$name.log" 2>&1
  echo "$(date +%T) $name: rc=$? in $((SECONDS - start)) s"
  grep -E "^\|" "$out/$name.log" | tail -6
  grep -iE "error|Traceback|out of memory|KV pool|pool" "$out/$name.log" | tail -5
}
M="--offline --model qwen3-30b-a3b --devices cuda"
for part in "$@"; do
  case "$part" in
    probes)
      timeout 200 python3 $here/probe_few_rows.py 2>&1 | tee "$out/probe_few_rows.log" | grep -v Warning
      timeout 200 python3 $here/probe_prefill_pieces.py 2>&1 | tee "$out/probe_prefill_pieces.log" | grep -v Warning
      ;;
    pieces)
      timeout 60 python3 $here/probe_prefill_pieces.py 2>&1 | tee "$out/probe_prefill_pieces.log" | grep -v Warning
      ;;
    tests)
      timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/gpu -k "mixture or moe or few_rows" 2>&1 \
          | tee "$out/tests.log" | grep -E "passed|failed|error|FAIL|diff" | tail -20
      ;;
    engine)
      bench engine-1row 200 sweep $M --lengths 8192,32768 --repeats 2 --warmup 1 --output-len 64 --label "engine, 1 GPU"
      bench engine-16x8k 120 sweep $M --lengths 8192 --batch 16 --output-len 64 --repeats 1 --warmup 1 --label "engine, 16 x 8K"
      ;;
    engine64)
      bench engine-64x2k 120 sweep $M --lengths 2048 --batch 64 --output-len 64 --repeats 1 --warmup 1 --label "engine, 64 x 2K"
      ;;
    floor)
      timeout 100 python3 $here/floor.py 8192,32768 2>&1 | grep -v -i warn | tee "$out/floor.log"
      ;;
    hf)
      bench hf-ttft 400 sweep $M --sp-strategy transformers --lengths 8192,32768 --repeats 2 --warmup 1 --label transformers
      ;;
  esac
done

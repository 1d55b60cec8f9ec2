#!/usr/bin/env bash
# qwen3-30b-a3b (random weights, Qwen3-30B-A3B's shapes) on one GPU: the experts' GPU tests, the prefill's pieces, the
# engine's TTFT / TPOT bf16 and -q fp8 against the same machine's floor and transformers. Under scripts/gpu.sh's header,
# three back-to-back calls (flash-attn-4 travels in the first three):
#   [".fa4a", ".whl"]  bash scripts/gpu.sh run bash docs/results/2026-12-07-1xGPU-moe-engine/driver.sh tests
#   [".fa4c"]          bash scripts/gpu.sh run bash docs/results/2026-12-07-1xGPU-moe-engine/driver.sh pieces
#   [".fa4b"]          bash scripts/gpu.sh run bash docs/results/2026-12-07-1xGPU-moe-engine/driver.sh engine floor
#   (none)             ... driver.sh batch fp8 hf
# Parts:
#   tests:  the GPU tests of the experts (engine fp32 and bf16 against transformers, the grouped GEMMs, FP8 experts)
#   pieces: a prefill piece through one layer's experts, stage by stage (docs/results/2026-12-07-1xGPU-moe)
#   engine: bf16 TTFT 8K / 32K / 128K (2 each; 128K on an H200 only) and TPOT 1 x 8K / 32K / 128K (64 tokens out)
#   floor:  bare kernels and bytes at 8K / 32K / 128K (docs/results/2026-12-07-1xGPU-moe/floor.py)
#   batch:  bf16 16 x 8K and 64 x 2K (64 tokens out)
#   fp8:    -q fp8: TTFT 8K / 32K / 128K and TPOT 1 x 8K / 1 x 128K; 16 x 8K
#   hf:     transformers (grouped_mm experts, sdpa) TTFT 8K / 32K
#   capacity: the KV pool and the activations' row limit with default flags: bf16 and FP8 pages, bf16 and -q fp8 weights
#   fp8profile: as profile's prefill part with -q fp8 (8K, 32K)
#   million: 1,048,576 tokens, --kv-cache-dtype fp8 -q fp8, TTFT and 16 tokens' TPOT (a call of its own, H200)
#   million-fp8attn: the same with --attention-backend fa3-fp8
#   profile: where the time goes: a prefill of 8K and 32K by kernel (scripts/gpu_prefill_profile.py), a decode step
#            at 8K by kernel in its CUDA graph (scripts/gpu_decode_profile.py)
set -u
out=${OUT:-/tmp/burstserve-gpu}
probes=docs/results/2026-12-07-1xGPU-moe
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader > "$out/gpu.txt"
bench() {   # bench NAME LIMIT ARGS...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  mkdir -p "$out/$name"
  timeout "$limit" python3 -m burstserve.clients.bench "$@" --output-dir "$out/$name" > "$out/$name/stdout.log" \
      2> "$out/$name/stderr.log"
  echo "$(date +%T) $name: rc=$? in $((SECONDS - start)) s"
  grep -E "^\|" "$out/$name/stdout.log" | tail -5
  grep -hE "KV pool|GiB in use" "$out/$name/stderr.log" | head -2
  grep -iE "Traceback|out of memory|Error" "$out/$name/stderr.log" | tail -3
}
M="sweep --offline --model qwen3-30b-a3b --devices cuda"
for part in "$@"; do
  case "$part" in
    tests)
      timeout 280 python3 -m pytest -q -s -p no:cacheprovider -p no:warnings tests/gpu/test_gpu.py \
          tests/gpu/test_kernels_gpu.py tests/engine/test_moe_fp8.py -m gpu \
          -k "mixture or grouped_experts or fp8_experts_on_a_gpu or router_kernel or fused_kernels_match" 2>&1 | tee "$out/tests.log" \
          | grep -E "passed|failed|error|diff|err|greedy|FAIL|Error|assert" | tail -30
      ;;
    pieces)
      timeout 120 python3 $probes/probe_prefill_pieces.py 2>&1 | grep -v -i warn | tee "$out/pieces.log"
      ;;
    engine)
      bench engine-bf16 200 $M --lengths 8192,32768 --repeats 2 --warmup 1 --output-len 64 --label "engine, bf16"
      if grep -q H200 "$out/gpu.txt"; then      # an H100's KV pool (93,952 tokens beside the bf16 weights) refuses it
        bench engine-bf16-128k 200 $M --lengths 131072 --repeats 2 --warmup 1 --output-len 64 --label "engine, bf16"
      fi
      ;;
    floor)
      timeout 120 python3 $probes/floor.py 8192,32768,131072 2>&1 | grep -v -i "warn\|exe_args" | tee "$out/floor.log"
      ;;
    batch)
      bench engine-16x8k 120 $M --lengths 8192 --batch 16 --output-len 64 --repeats 1 --warmup 1 --label "engine, 16 x 8K"
      bench engine-64x2k 120 $M --lengths 2048 --batch 64 --output-len 64 --repeats 1 --warmup 1 --label "engine, 64 x 2K"
      ;;
    fp8)
      bench engine-fp8 240 $M -q fp8 --lengths 8192,32768,131072 --repeats 1 --warmup 1 --output-len 64 --label "engine, -q fp8"
      bench engine-fp8-16x8k 120 $M -q fp8 --lengths 8192 --batch 16 --output-len 64 --repeats 1 --warmup 1 \
          --label "engine, -q fp8, 16 x 8K"
      ;;
    hf)
      bench hf 200 $M --sp-strategy transformers --lengths 8192,32768 --repeats 1 --warmup 1 --label transformers
      ;;
    profile)
      MODEL=qwen3-30b-a3b TOP=30 timeout 200 python3 scripts/gpu_prefill_profile.py 8192,32768 2>&1 \
          | grep -v -i "warn\|exe_args" | tee "$out/profile-prefill.log"
      MODEL=qwen3-30b-a3b timeout 150 python3 scripts/gpu_decode_profile.py 8192 2>&1 | grep -v -i "warn\|exe_args" \
          | tee "$out/profile-decode.log"
      ;;
    capacity)
      MODEL=qwen3-30b-a3b timeout 300 python3 scripts/gpu_kv_capacity.py auto auto:fp8 fp8 fp8:fp8 2>&1 \
          | grep -v -i "warn\|exe_args" | grep "^|\|on \|Error" | tee "$out/capacity.log"
      ;;
    fp8profile)
      QUANT=fp8 MODEL=qwen3-30b-a3b TOP=25 timeout 200 python3 scripts/gpu_prefill_profile.py 8192,32768 2>&1 \
          | grep -v -i "warn\|exe_args" | tee "$out/profile-prefill-fp8.log"
      ;;
    million)      # about 500 s of attention alone: the call's first and only part, on an H200
      bench million 595 $M --kv-cache-dtype fp8 -q fp8 --lengths 1048576 --repeats 1 --warmup 0 --output-len 16 \
          --label "engine, fp8 KV, -q fp8"
      ;;
    million-fp8attn)   # the same with FP8 attention (FlashAttention-3's FP8 forward: .fa3 carried, ../shared/gpu/fa3-prepare.sh)
      bench million-fp8attn 595 $M --kv-cache-dtype fp8 -q fp8 --attention-backend fa3-fp8 --lengths 1048576 \
          --repeats 1 --warmup 0 --output-len 16 --label "engine, fp8 KV, -q fp8, fa3-fp8 attention"
      ;;
  esac
done

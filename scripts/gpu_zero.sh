#!/usr/bin/env bash
# Issue 14 on nvidia-h200-x2 (2 GPUs; CP=8 on nvidia-h200-x8): BurstAttention+ZeRO (`--sp-strategy burst-zero`). Two back-to-back
# device calls (after ../shared/gpu/prepare.sh and ../shared/gpu/fa4-prepare.sh here):
#   1. carry [".fa4a"]:          mkdir -p /tmp/fa4 && cp .fa4a/part.aa /tmp/fa4/
#   2. carry [".fa4b", ".whl"]:  bash scripts/gpu_zero.sh      (within ~30 s of the first)
# PARTS (default "tests 8b short 70b"; all four can outlast one device call's 600 s: run PARTS="tests 8b short"
# and PARTS=70b as two calls, each within 30 s of the one before so the machine stays warm):
#   tests  the 2-GPU GPU tests of burst-zero against transformers (bf16);
#   8b     llama3-8b, `bench sweep --offline` at 8K/32K/128K with 64 output tokens: burst-zero (weights
#          sliced) against burst (weights whole), same run: TTFT and time per output token;
#   short  llama3-8b at 1K-8K: burst-zero with short prompts on the weight slices (the threshold measured
#          at start, in the log) against --zero-sliced-max-tokens 0 (every prompt gathered) and burst;
#   70b    llama3-70b at 128K (LONG_70B), 16 output tokens: burst-zero, tp, tp-v3 (STRATEGIES_70B) (TTFT, TPOT, peak
#          memory per GPU), and transformers on one GPU (its 141 GB of weights: OOM).
# Results: $OUT/results.tgz, one directory per configuration, merged tables in merged-8b/ and merged-70b/.
set -uo pipefail
source "$(dirname "$0")/gpu_fa4_env.sh"   # flash-attn-4, gpu_env.sh, pack on exit, env.txt
PARTS=${PARTS:-tests 8b short 70b}

sweep() { local name=$1 limit=$2; shift 2; offline_sweep "$name" "$limit" cuda "${CP:-2}" "$@"; }   # gpu_env.sh
if [[ " $PARTS " == *" tests "* ]]; then
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu -k "(every_strategy and burst-zero) or measures_which_prompts" 2>&1 \
      | grep -E "logit diff|passed|failed|Error" | tee "$out/tests.log"
fi
if [[ " $PARTS " == *" 8b "* ]]; then
  for s in burst-zero burst; do
    sweep "8b-$s" 240 --model llama3-8b --sp-strategy "$s" --lengths 8192,32768,131072 --output-len 64 --repeats 2 --warmup 1
  done
  python3 -m server.cli bench merge "$out"/8b-*/results.json --output-dir "$out/merged-8b" > /dev/null
fi
if [[ " $PARTS " == *" short "* ]]; then
  short="--model llama3-8b --lengths 1024,2048,4096,8192 --repeats 3 --warmup 1"
  BURSTSERVE_LOG_LEVEL=INFO sweep "short-burst-zero" 200 $short --sp-strategy burst-zero
  grep -h "run on the weight slices" "$out/short-burst-zero/stderr.log" | head -2
  sweep "short-burst-zero-gathered" 200 $short --sp-strategy burst-zero --zero-sliced-max-tokens 0
  sweep "short-burst" 200 $short --sp-strategy burst
  python3 -m server.cli bench merge "$out"/short-*/results.json --output-dir "$out/merged-short" > /dev/null
fi
if [[ " $PARTS " == *" 70b "* ]]; then
  for s in ${STRATEGIES_70B:-burst-zero tp tp-v3}; do
    sweep "70b-$s" "${LIMIT_70B:-280}" --model llama3-70b --sp-strategy "$s" --lengths "${LONG_70B:-131072}" --output-len 16 \
        --repeats 1 --warmup 0
  done
  mkdir -p "$out/70b-transformers"                 # one GPU: its weights alone exceed the GPU, shown as OOM
  timeout 200 python3 -m server.cli bench sweep --offline --model llama3-70b --devices cuda:0 --sp-strategy transformers \
      --lengths "${LONG_70B:-131072}" --repeats 1 --warmup 0 --label "transformers, 1 GPU" \
      --output-dir "$out/70b-transformers" > "$out/70b-transformers/stdout.log" 2> "$out/70b-transformers/stderr.log"
  grep -E "^\|" "$out/70b-transformers/stdout.log" | tail -3
  python3 -m server.cli bench merge "$out"/70b-*/results.json --output-dir "$out/merged-70b" > /dev/null
fi

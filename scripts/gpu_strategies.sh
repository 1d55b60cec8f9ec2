#!/usr/bin/env bash
# Every prefill strategy on 2 GPUs: bf16 exactness vs transformers, then a short offline sweep of the
# llama3-8b preset, or MODEL=llama2-7b for the paper's table (one table, OOM shown as OOM).
set -uo pipefail
source "$(dirname "$0")/gpu_fa4_env.sh"   # flash-attn-4 where carried, gpu_env.sh, pack on exit
timeout 170 python3 -m pytest -q -s -m gpu tests/gpu -k every_strategy 2>&1 | grep -E "logit diff|passed|failed|Error" \
    | tee "$out/strategies_tests.log"
results=()
for s in ${STRATEGIES:-burst burst-nolao ring-rsa ulysses cqs tp tp-v3 burst-zero}; do
  timeout 60 python3 -m server.cli bench sweep --offline --model ${MODEL:-llama3-8b} --devices cuda -cp 2 --sp-strategy "$s" \
      --lengths ${LENGTHS:-16384,65536} --repeats 1 --label "$s, 2 GPU" --output-dir "$out/$s" >/dev/null 2>"$out/$s.err" \
      && results+=("$out/$s/results.json") || echo "$s: failed or timed out: $(tail -c 300 "$out/$s.err")"
done
python3 -m server.cli bench merge "${results[@]}" --output-dir "$out/merged"

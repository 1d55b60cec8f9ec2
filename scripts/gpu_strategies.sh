#!/usr/bin/env bash
# Every prefill strategy on 2 GPUs: bf16 exactness vs transformers, then a short offline sweep of the
# llama3-8b preset (one table, OOM shown as OOM).
set -uo pipefail
out=${OUT:-/tmp/burstserve-gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 170 python3 -m pytest -q -s -m gpu tests/gpu -k every_strategy 2>&1 | grep -E "logit diff|passed|failed|Error" \
    | tee "$out/strategies_tests.log"
results=()
for s in burst ring-rsa ulysses cqs tp; do
  timeout 60 python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda:2 --sp-strategy "$s" \
      --lengths ${LENGTHS:-16384,65536} --repeats 1 --label "$s, 2 GPU" --output-dir "$out/$s" >/dev/null 2>"$out/$s.err" \
      && results+=("$out/$s/results.json") || echo "$s: failed or timed out: $(tail -c 300 "$out/$s.err")"
done
python3 -m server.cli bench merge "${results[@]}" --output-dir "$out/merged"

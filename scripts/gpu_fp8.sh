#!/usr/bin/env bash
# CP=2 (on nvidia-h200-x2): the engine over 2 GPUs (-cp 2; default 1).
# Issue 13 item 4 on one GPU: the FP8 GPU test (tests/gpu/test_gpu.py -k fp8), then scripts/gpu_fp8.py
# (llama3-8b preset, bf16 vs --quantization fp8: logits over every position and the forward pass's
# time, same weights, same run). Two back-to-back device calls, as scripts/gpu_decode.sh.
set -uo pipefail
bash .fa4b/install.sh || exit 3
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
trap pack EXIT
{ date -u; nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__)"; } 2>&1 | tee "$out/env.txt"
[ -n "${SKIP_TESTS:-}" ] || timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -s -p no:cacheprovider -p no:warnings -m gpu \
    tests/gpu/test_gpu.py -k fp8 2>&1 | grep -v -i warn | tail -20 | tee "$out/pytest.log"
OUT=$out timeout 200 python3 scripts/gpu_fp8.py ${FP8_LENGTHS:-8192 16384} 2>&1 | grep -v -i warn | tail -8 | tee "$out/fp8.log"
# SWEEP=1: the engine's TTFT, bf16 and --quantization fp8, `bench sweep --offline` one after the other;
# SWEEP_QUANT (default "none fp8") may add fp8-unfused: fp8 with BURSTSERVE_FP8_UNFUSED=1 (activations
# quantized by their own kernel, not by the norm and silu kernels: the A/B of that fusion)
if [ -n "${SWEEP:-}" ]; then
  for q in ${SWEEP_QUANT:-none fp8}; do
    quant=${q%-unfused}
    unfused=$([ "$q" = fp8-unfused ] && echo 1 || echo 0)
    BURSTSERVE_FP8_UNFUSED=$unfused timeout 240 python3 -m server.cli bench sweep --offline --model llama3-8b \
        --devices cuda -cp "${CP:-1}" --lengths "${SWEEP_LENGTHS:-8192,32768,131072}" --repeats 2 --warmup 1 \
        --quantization "$quant" --output-dir "$out/sweep-$q" > "$out/sweep-$q.log" 2>&1
    echo "quantization $q: rc=$?"; grep -E "^\|" "$out/sweep-$q.log" | tail -5
  done
fi

#!/usr/bin/env bash
# Everything GPU for the engine in one go (H200 machines via the device tool): GPU tests, then the
# first prefill table. Usage: scripts/gpu_check.sh [GPUS=1,2] [LENGTHS=32768,131072]
set -uo pipefail
gpus=${1:-1,2}
lengths=${2:-32768,131072}
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
timeout 300 python3 -m pytest -q -m gpu tests/gpu 2>&1 | tee "$out/gpu_tests.log"
timeout 420 python3 -m clients.prefill_table --model llama3-8b --lengths "$lengths" --gpus "$gpus" \
    --repeats 2 --no-overlap-too --output "$out/benchmarks.md" --json "$out/prefill.json" 2>&1 | tee "$out/prefill.log"

#!/usr/bin/env bash
# The end-of-session GPU run, in one call: GPU tests, then the HTTP server with the llama3-8b preset
# on all GPUs answering streaming 32K-token prompts, then the overlap experiment. The prefill tables
# are scripts/gpu_bench.sh's. Needs the wheels in .whl/ (fastapi...).
set -uo pipefail
source "$(dirname "$0")/gpu_fa4_env.sh"   # flash-attn-4 where carried, gpu_env.sh, pack on exit
echo "GPUs: $(nvidia-smi -L | wc -l)"
[ -n "${SKIP_GPU_TESTS:-}" ] || timeout 360 python3 -m pytest -q -m gpu tests/gpu 2>&1 | tail -3 | tee "$out/gpu_tests.log"
python3 -m server.cli serve --model llama3-8b --devices cuda --port 8000 --log-level info > "$out/server.log" 2>&1 &
server=$!
for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
# the same length three times, then three new lengths once each: what a new prompt length costs
timeout 150 python3 -m clients.ttft_probe --url http://127.0.0.1:8000 --prompt-tokens 32768 --vocab 128256 \
    --repeats 3 2>&1 | tee "$out/server_ttft.json"
timeout 150 python3 -m clients.ttft_probe --url http://127.0.0.1:8000 --prompt-tokens 32769,32770,32771,32768 \
    --vocab 128256 --repeats 1 2>&1 | tee -a "$out/server_ttft.json"
curl -s http://127.0.0.1:8000/metrics | grep -E "^burstserve:(request_prefill_time_seconds_(sum|count)|ring_exchange_hidden_fraction_(sum|count)|time_to_first_token_seconds_(sum|count))" | tee -a "$out/server_ttft.json"
kill -TERM $server; wait $server
grep -E "kernel|listening|Shutting|shutting" "$out/server.log" | head -5
timeout 120 python3 scripts/overlap_experiment.py 2>&1 | grep -v -i warn | tee "$out/overlap.md"

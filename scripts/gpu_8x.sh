#!/usr/bin/env bash
# Issue 16 on nvidia-h200-x8 (8 GPUs), what scripts/gpu_bench.sh (the prefill tables) and
# scripts/gpu_zero.sh (the 70B preset: CP=8 LONG_70B=131072,524288) do not: after the flash-attn-4 calls
# of scripts/gpu_prefix.sh's header, one part per device call (each within 10 minutes):
#   PARTS=million  llama3-8b, one prompt of 1,048,576 tokens end to end over 8 GPUs (TTFT, then 64 decoded
#                  tokens: time per output token, peak memory per GPU), and PyTorch's context_parallel
#                  (torch-cp) at 1M in the same call; MILLION=2097152 for the 2M run;
#   PARTS=scaling  llama3-8b and llama2-7b at 65536 and 131072 tokens on 4 GPUs (burst, auto, torch-cp):
#                  the 4-GPU column of the scaling table (1 and 2 GPUs: gpu_bench.sh small-counts; 8: its
#                  strategies run), merged with `bash scripts/bench_docs.sh`.
# Results: $OUT/results.tgz, one directory per configuration (results.json for `burstserve bench merge`).
# KIND=cpu MODEL=tiny MILLION=4096 GPUS=2 runs the same commands on CPU workers (a dry run).
set -uo pipefail
if [ "${KIND:-cuda}" = cuda ]; then
  bash .fa4b/install.sh || exit 3
fi
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
trap pack EXIT
KIND=${KIND:-cuda}
GPUS=${GPUS:-8}
{ date -u; [ "$KIND" = cuda ] && nvidia-smi -L; git log -1 --format=%h 2>/dev/null; } 2>&1 | tee "$out/env.txt"

sweep() { local name=$1 limit=$2 workers=$3; shift 3; offline_sweep "$name" "$limit" "$KIND" "$workers" "$@"; }   # gpu_env.sh
case "${PARTS:-million}" in
  million)
    n=${MILLION:-1048576}
    sweep "burst-$GPUS-million" 420 "$GPUS" --model "${MODEL:-llama3-8b}" --lengths "$n" --output-len 64 --repeats 1 \
        --warmup 0
    sweep "torch-cp-$GPUS-million" 170 "$GPUS" --model "${MODEL:-llama3-8b}" --sp-strategy torch-cp --lengths "$n" \
        --repeats 1 --warmup 0 ;;
  scaling)
    for model in ${MODELS:-llama3-8b llama2-7b}; do
      for s in burst auto torch-cp; do
        sweep "$model/$s-4" 150 4 --model "$model" --sp-strategy "$s" --lengths 65536,131072 --repeats 1 --warmup 1
      done
    done ;;
  *) echo "PARTS: million | scaling" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The prefill tables of docs/benchmarks.md, measured with `burstserve bench sweep --offline`, in
# device calls that each fit in 10 minutes on 4 x H200 (one process per configuration):
#   bash scripts/gpu_bench.sh small-counts       # 1 GPU: transformers and the engine (`single`);
#                                                # 2 GPUs: every strategy at the scaling length;
#                                                # both models, the GPUs split between concurrent runs
#   bash scripts/gpu_bench.sh strategies MODEL.. # every strategy on all GPUs over LENGTHS, then burst
#                                                # with --no-overlap at 32K and 128K
#   bash scripts/gpu_bench.sh backends MODEL..   # burst on all GPUs with --attention-backend flash-attn,
#                                                # then cudnn, over BACKEND_LENGTHS (issue 18's table)
# Results: $out/results.tgz holding MODEL/CONFIG/results.json; scripts/bench_docs.sh merges them into the docs.
# KIND=cpu runs the same commands on CPU workers (a dry run: MODELS=tiny LENGTHS=64,256).
set -uo pipefail
source "$(dirname "$0")/gpu_fa4_env.sh"   # flash-attn-4 where carried, gpu_env.sh, pack on exit
KIND=${KIND:-cuda}
MODELS=${MODELS:-llama3-8b llama2-7b}
LENGTHS=${LENGTHS:-4096,8192,16384,32768,65536,131072,262144}
SCALING_LENGTH=${SCALING_LENGTH:-65536}
OVERLAP_LENGTHS=${OVERLAP_LENGTHS:-32768,131072}
BACKEND_LENGTHS=${BACKEND_LENGTHS:-8192,32768,131072}
REPEATS=${REPEATS:-2}
LIMIT=${LIMIT:-170}          # seconds per configuration on 2+ GPUs
LIMIT_ONE=${LIMIT_ONE:-330}  # seconds per configuration on one GPU (256K there takes ~45 s a request)
STRATEGIES=${STRATEGIES:-burst auto torch-cp tp tp-v3 burst-zero ulysses cqs burst-nolao ring-rsa}
if [ "$KIND" = cuda ]; then gpus=$(nvidia-smi -L | wc -l); else gpus=4; fi

# sweep NAME MODEL WORKERS VISIBLE ARGS...: one configuration in its own process, WORKERS workers on the
# first WORKERS visible devices (--devices $KIND -cp WORKERS), VISIBLE (if set) restricting the GPUs it
# sees; prints one status line.
sweep() {
  local name=$1 model=$2 workers=$3 visible=$4; shift 4
  local dir="$out/$model/$name"
  mkdir -p "$dir"
  local start=$SECONDS
  env ${visible:+CUDA_VISIBLE_DEVICES=$visible} timeout "$LIMIT" python3 -m server.cli bench sweep --offline \
      --model "$model" --devices "$KIND" -cp "$workers" --repeats "$REPEATS" --warmup 1 --output-dir "$dir" "$@" \
      > "$dir/stdout.log" 2> "$dir/stderr.log"
  local rc=$?
  echo "$(date +%T) $model $name: rc=$rc in $((SECONDS - start)) s$([ $rc = 0 ] || echo "; $(grep -v -i warn "$dir/stderr.log" | tail -c 300)")"
}

small_counts() {
  local i=0 pids=()
  for model in $MODELS; do   # 1 GPU: two runs per model at once, one GPU each
    LIMIT=$LIMIT_ONE sweep "transformers-1" "$model" 1 "$([ "$KIND" = cuda ] && echo $i)" --sp-strategy transformers \
        --lengths "$LENGTHS" --label "transformers, 1 GPU" & pids+=($!)
    LIMIT=$LIMIT_ONE sweep "single-1" "$model" 1 "$([ "$KIND" = cuda ] && echo $((i + 1)))" --sp-strategy single \
        --lengths "$LENGTHS" --label "engine (single), 1 GPU" & pids+=($!)
    i=$((i + 2))
  done
  wait "${pids[@]}"
  i=0 pids=()
  for model in $MODELS; do   # 2 GPUs: one pair of GPUs per model
    visible=$([ "$KIND" = cuda ] && echo "$i,$((i + 1))")
    (for s in $STRATEGIES; do
       sweep "$s-2" "$model" 2 "$visible" --sp-strategy "$s" --lengths "$SCALING_LENGTH" \
           --label "$s, 2 GPU"
     done) & pids+=($!)
    i=$((i + 2))
  done
  wait "${pids[@]}"
}

strategies() {
  local model=$1
  for s in $STRATEGIES; do
    sweep "$s-$gpus" "$model" "$gpus" "" --sp-strategy "$s" --lengths "$LENGTHS" --label "$s, $gpus GPU"
  done
  sweep "burst-nolap-$gpus" "$model" "$gpus" "" --sp-strategy burst --no-overlap \
      --lengths "$OVERLAP_LENGTHS" --label "burst, no overlap, $gpus GPU"
}

backends() {
  local model=$1
  for b in flash-attn cudnn; do
    sweep "burst-$b-$gpus" "$model" "$gpus" "" --sp-strategy burst --attention-backend "$b" \
        --lengths "$BACKEND_LENGTHS" --label "burst, $b, $gpus GPU"
  done
}

echo "$(date +%T) $KIND x $gpus; models: $MODELS; lengths: $LENGTHS"
case "${1:-}" in
  small-counts) small_counts ;;
  strategies) shift; for model in "$@"; do strategies "$model"; done ;;
  backends) shift; for model in "$@"; do backends "$model"; done ;;
  *) echo "usage: $0 small-counts | strategies MODEL... | backends MODEL..." >&2; exit 2 ;;
esac

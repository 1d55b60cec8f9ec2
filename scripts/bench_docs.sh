#!/usr/bin/env bash
# Merges `scripts/gpu.sh bench`'s results (RESULTS/MODEL/CONFIG/results.json) into one markdown page
# (default RESULTS/merged.md, its plots beside it; docs/benchmarks.md takes the latest tables from it by hand)
# with `burstserve bench merge --doc`: per model, every strategy over the prompt lengths; the scaling
# table at SCALING_LENGTH over 1, 2 and all GPUs; burst with and without overlap.
#   bash scripts/bench_docs.sh RESULTS [DOC]
set -euo pipefail
results=${1:?RESULTS directory}
doc=${2:-$results/merged.md}
MODELS=${MODELS:-llama3-8b llama2-7b}
SCALING_LENGTH=${SCALING_LENGTH:-65536}
OVERLAP_LENGTHS=${OVERLAP_LENGTHS:-32768,131072}
STRATEGIES=${STRATEGIES:-burst auto torch-cp burst-nolao ring-rsa ulysses tp tp-v3 burst-zero cqs}
work=$(mktemp -d)

existing() { for p in "$@"; do [ -f "$p" ] && echo "$p"; done; return 0; }

for model in $MODELS; do
  dir=$results/$model
  gpus=$(ls -d "$dir"/burst-[0-9]* | sed 's/.*-//' | sort -n | tail -1)
  all=$(existing "$dir/transformers-1/results.json" "$dir/single-1/results.json" \
        $(for s in $STRATEGIES; do echo "$dir/$s-$gpus/results.json"; done))
  python3 -m burstserve.clients.bench merge $all --output-dir "$work/$model-all" --doc "$doc" --section "$model" --scaling-length 0 \
      --title "Prefill: time to first token, \`$model\` preset, every strategy on $gpus GPUs (bf16, batch 1)"
  scaling=$(existing "$dir/transformers-1/results.json" "$dir/single-1/results.json" \
            $(for s in $STRATEGIES; do for g in 2 4 8; do echo "$dir/$s-$g/results.json"; done; done))
  python3 -m burstserve.clients.bench merge $scaling --lengths "$SCALING_LENGTH" --output-dir "$work/$model-scaling" \
      --doc "$doc" --section "$model-scaling" --scaling-length "$SCALING_LENGTH" \
      --title "Scaling: \`$model\` at $SCALING_LENGTH tokens over GPU counts"
  overlap=$(existing "$dir/burst-$gpus/results.json" "$dir/burst-nolap-$gpus/results.json")
  python3 -m burstserve.clients.bench merge $overlap --lengths "$OVERLAP_LENGTHS" --output-dir "$work/$model-overlap" \
      --doc "$doc" --section "$model-overlap" \
      --title "Overlap: \`$model\`, burst on $gpus GPUs with and without double buffering (--no-overlap)"
done
rm -rf "$work"

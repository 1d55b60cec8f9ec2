#!/usr/bin/env bash
# CP=2 (on nvidia-h200-x2): the engine over 2 GPUs (-cp 2; default 1).
# Issue 11 on one GPU: the paged KV cache and the decode CUDA graphs checked against eager decode and
# transformers (tests/gpu/test_gpu.py), then `burstserve bench sweep --offline --output-len` for the
# engine (llama3-8b preset, bf16) and for transformers with a static cache under torch.compile, the
# peer, in the same run. Two back-to-back device calls (after ../shared/gpu/prepare.sh and
# ../shared/gpu/fa4-prepare.sh here):
#   1. carry [".fa4a"]:          mkdir -p /tmp/fa4 && cp .fa4a/part.aa /tmp/fa4/
#   2. carry [".fa4b", ".whl"]:  bash scripts/gpu_decode.sh      (within ~30 s of the first)
# SYNC_AB=1: the sweep's engine configurations (and the load's default server) also with --no-async-scheduling
# (A/B); SKIP_PEER=1: no transformers. NO_CHUNKED_LOAD=1: the load without its chunked server.
# PARTS (default "tests kernels sweep"): "half" the sweep's configurations at half the context (below); "load" adds issue 11's HTTP load, `burstserve bench load` with 48
# prompts of 8K tokens, 128 output tokens, concurrency 16, on a default server and on one with chunked
# prefill (--max-num-batched-tokens LOAD_CHUNK, default 2048: an 8K prompt in chunks, the ITL target's
# default 50 ms, the mixed batch where graphed).
# Results: $OUT/results.tgz (pytest log, one results.json / table per configuration).
set -uo pipefail
bash .fa4b/install.sh || exit 3
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
trap pack EXIT
{ date -u; nvidia-smi -L; python3 -c "import torch, flash_attn.cute as c; print('torch', torch.__version__, 'flash_attn.cute', c.__version__)"; } 2>&1 | tee "$out/env.txt"
OUTPUT_LEN=${OUTPUT_LEN:-128}
PARTS=${PARTS:-tests kernels sweep}
has() { [[ " $PARTS " == *" $1 "* ]]; }

[ -n "${SKIP_TESTS:-}" ] || ! has tests || timeout "${TEST_LIMIT:-130}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py \
    -k "one_gpu or cuda_graphs" 2>&1 | tail -40 | tee "$out/pytest.log"

# bench NAME LIMIT ARGS...: one configuration in its own process
bench() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  mkdir -p "$out/$name"
  timeout "$limit" python3 -m server.cli bench sweep --offline --model llama3-8b --devices cuda -cp "${BENCH_CP:-${CP:-1}}" \
      --output-len "$OUTPUT_LEN" --repeats 1 --warmup 1 --output-dir "$out/$name" "$@" \
      > "$out/$name/stdout.log" 2> "$out/$name/stderr.log"
  local rc=$?
  echo "$(date +%T) $name: rc=$rc in $((SECONDS - start)) s"
  grep -E "^\|" "$out/$name/stdout.log" | tail -4
  [ $rc = 0 ] || grep -v -i warn "$out/$name/stderr.log" | tail -5
}
if has kernels; then
  SKIP_TESTS=1 SKIP_BLOCKS=1 OUT=$out/kernels timeout 80 bash scripts/gpu_kernels.sh > "$out/kernels.log" 2>&1
  grep -A12 "paged decode, one layer" "$out/kernels.log"; grep -A5 "num_chunks sweep" "$out/kernels.log"
fi
# engine_sweep SUFFIX ARGS...: the engine's four configurations, ARGS added, SUFFIX on their names and labels
engine_sweep() {
  local s=$1; shift
  bench "engine-1x8K$s" 50 --lengths 8192 --label "engine, ${CP:-1} GPU, 1 stream$s" "$@"
  bench "engine-1x128K$s" 80 --lengths 131072 --label "engine, ${CP:-1} GPU, 1 stream$s" "$@"
  bench "engine-16x8K$s" 50 --lengths 8192 --batch 16 --label "engine, ${CP:-1} GPU, 16 streams$s" "$@"
  bench "engine-64x2K$s" 50 --lengths 2048 --batch 64 --label "engine, ${CP:-1} GPU, 64 streams$s" "$@"
}
# "half": the four configurations at half their context on one GPU: what each of 2 workers reads per step
# (all the weights, half the KV) without the per-layer merge of the 2-GPU step; a proxy, not the 2-GPU figure
if has half; then
  bench "half-1x4K" 50 --lengths 4096 --label "1 GPU, 1 stream, 4K (half of 8K)"
  bench "half-1x64K" 60 --lengths 65536 --label "1 GPU, 1 stream, 64K (half of 128K)"
  bench "half-16x4K" 50 --lengths 4096 --batch 16 --label "1 GPU, 16 streams, 4K (half of 8K)"
  bench "half-64x1K" 50 --lengths 1024 --batch 64 --label "1 GPU, 64 streams, 1K (half of 2K)"
fi
if has sweep; then
engine_sweep ""
# SYNC_AB=1: the same with every decode step read back before the next is launched (--no-async-scheduling)
[ -z "${SYNC_AB:-}" ] || engine_sweep "-sync" --no-async-scheduling
[ -n "${SKIP_PEER:-}" ] || BENCH_CP=1 bench transformers-1x 100 --sp-strategy transformers --lengths 8192 \
    --label "transformers static+compile, 1 GPU"
fi

# load NAME LIMIT SERVE_ARGS...: `bench load` against a server started with these arguments
load() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  mkdir -p "$out/$name"
  timeout "$limit" python3 -m server.cli bench load --serve "--model llama3-8b --devices cuda -cp ${CP:-1} $*" \
      --num-prompts 48 --input-len 8192 --output-len 128 --max-concurrency 16 --label "$name" \
      --output-dir "$out/$name" > "$out/$name/stdout.log" 2> "$out/$name/stderr.log"
  local rc=$?
  echo "$(date +%T) $name: rc=$rc in $((SECONDS - start)) s"
  grep -E "^\| (completed|failed|duration|output_throughput|(mean|median|p99)_(ttft|tpot|itl)_ms) " "$out/$name/stdout.log"
  [ $rc = 0 ] || grep -v -i warn "$out/$name/stderr.log" | tail -5
}
if has load; then
  load load-default 200
  [ -z "${SYNC_AB:-}" ] || load load-default-sync 200 --no-async-scheduling
  [ -n "${NO_CHUNKED_LOAD:-}" ] || load load-chunked 200 --max-num-batched-tokens "${LOAD_CHUNK:-2048}" ${LOAD_EXTRA:-}
fi

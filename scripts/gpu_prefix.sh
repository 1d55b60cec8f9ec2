#!/usr/bin/env bash
# CP=2 (on nvidia-h200-x2): the engine over 2 GPUs (-cp 2; default 1).
# Issue 12 on one GPU (llama3-8b preset, bf16): the prefix cache's warm TTFT (`burstserve bench shared`,
# a 512-token question after a cached 32K and 128K document), and what a 128K prompt's prefill does to
# 8 decoding streams and to a 1K request arriving 0.5 s into it (`burstserve bench interference`), on a
# server with default flags (chunked prefill on), on one with --max-num-batched-tokens CHUNK and
# --itl-target-ms T for each T in ITL_TARGETS (none by default), and on one without chunked prefill (the long
# prompt prefilled in one call: its unchunked TTFT, the streams' stall; UNCHUNKED=0 leaves it out). Two back-to-back
# device calls (after ../shared/gpu/prepare.sh and ../shared/gpu/fa4-prepare.sh here):
#   1. carry [".fa4a"]:          mkdir -p /tmp/fa4 && cp .fa4a/part.aa /tmp/fa4/
#   2. carry [".fa4b", ".whl"]:  bash scripts/gpu_prefix.sh      (within ~30 s of the first)
# CHUNK: the ITL_TARGETS servers' --max-num-batched-tokens (default 8192). REPEATS: interference rounds (1).
# SERVE_EXTRA: more server arguments (say "--log-level debug": each chunk's size and time in stderr.log).
# PARTS="shared interference http" picks parts (http: issue 13's HTTP overhead, `bench sweep` over HTTP
# against --offline at 8K and 128K, same engine, same run, and the server's TTFT parts per request from its
# log via scripts/ttft_parts.py; HTTP_REPEATS, default 2). Results: $OUT/results.tgz (one directory per configuration).
set -uo pipefail
bash .fa4b/install.sh || exit 3
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
trap pack EXIT
{ date -u; nvidia-smi -L; git log -1 --format=%h 2>/dev/null; python3 -c "import torch, flash_attn.cute as c; print('torch', torch.__version__)"; } 2>&1 | tee "$out/env.txt"
PARTS=${PARTS:-shared interference http}
LONG=${LONG:-131072}

# run NAME LIMIT ARGS...: one bench in its own process, its table printed
run() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  mkdir -p "$out/$name"
  timeout "$limit" python3 -m server.cli bench "$@" --output-dir "$out/$name" \
      > "$out/$name/stdout.log" 2> "$out/$name/stderr.log"
  local rc=$?
  echo "$(date +%T) $name: rc=$rc in $((SECONDS - start)) s"
  grep -E "^\|" "$out/$name/stdout.log" | tail -8
  [ $rc = 0 ] || grep -v -i warn "$out/$name/stderr.log" | tail -8
}
offline="--offline --model llama3-8b --devices cuda -cp ${CP:-1}"
serve="--model llama3-8b --devices cuda -cp ${CP:-1} ${SERVE_EXTRA:-}"
if [[ " $PARTS " == *" shared "* ]]; then
  run shared-32K 150 shared $offline --doc-len 32768 --question-len 512 --questions 4 --repeats 2 --warmup 1
  run shared-128K 200 shared $offline --doc-len "$LONG" --question-len 512 --questions 3 --repeats 1 --warmup 1
fi
if [[ " $PARTS " == *" interference "* ]]; then
  common="--streams 8 --stream-len 1024 --long-len $LONG --short-len 1024 --short-delay 0.5 --warmup 1"
  common+=" --repeats ${REPEATS:-1}"
  run interference-default 330 interference --serve "$serve" $common --label "default flags"
  for target in ${ITL_TARGETS:-}; do
    run "interference-chunked-itl$target" 260 interference --serve "$serve --max-num-batched-tokens ${CHUNK:-8192} --itl-target-ms $target" \
        $common --label "chunked ${CHUNK:-8192}, itl target $target ms"
  done
  [ "${UNCHUNKED:-1}" = 0 ] || \
  run interference-unchunked 260 interference --serve "$serve --no-enable-chunked-prefill" $common --label "unchunked"
fi
if [[ " $PARTS " == *" http "* ]]; then
  sweep="--lengths 8192,$LONG --repeats ${HTTP_REPEATS:-2} --warmup 1"
  run sweep-offline 150 sweep $offline $sweep --label "offline"
  # the server as the offline LLM is (max_model_len = the longest prompt + 1), its request lines at info
  run sweep-http 170 sweep --serve "$serve --max-model-len $((LONG + 1)) --log-level info" $sweep --label "HTTP"
  python3 scripts/ttft_parts.py "$out/sweep-http/stderr.log" "$out/sweep-http/results.json" | tee "$out/sweep-http/ttft_parts.md"
fi

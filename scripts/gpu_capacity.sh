#!/usr/bin/env bash
# The longest prompt one GPU takes (llama3-8b preset, bf16), with and without chunked prefill: pool sizing
# reserves a whole prompt's activations for a one-call prefill and one chunk's with --max-num-batched-tokens
# (engine/cache/sizing.py). `burstserve bench sweep` runs over HTTP, each server started by the bench: one
# call (unless SKIP_ONE_CALL=1), then chunks of each size in $CHUNKS (default 16384); lengths $LENGTHS (a
# length past the one-call pool shows as its 400 row), $REPEATS timed after $WARMUP. Second of the two
# back-to-back device calls (see gpu_prefix.sh); GPU tests first unless SKIP_TESTS=1.
set -uo pipefail
source "$(dirname "$0")/gpu_fa4_env.sh"   # flash-attn-4, gpu_env.sh, pack on exit, env.txt
[ -n "${SKIP_TESTS:-}" ] || timeout 200 python3 -m pytest -q -s -p no:cacheprovider -p no:warnings --tb=short -m gpu \
    tests/gpu/test_gpu.py -k "pool_holds or one_gpu_matches" 2>&1 | grep -v -i warn | tail -20 | tee "$out/tests.log"
CHUNKS=${CHUNKS:-16384}
LENGTHS=${LENGTHS:-131072,524288}
serve="--model llama3-8b --devices cuda -cp ${CP:-1} --log-level info"   # CP=2 on nvidia-h200-x2
run() {   # run NAME LIMIT SERVE_ARGS LABEL
  local start=$SECONDS
  mkdir -p "$out/$1"
  timeout "$2" python3 -m server.cli bench sweep --serve "$3" --lengths "$LENGTHS" --repeats "${REPEATS:-1}" --warmup "${WARMUP:-0}" \
      --output-len 8 --label "$4" --output-dir "$out/$1" > "$out/$1/stdout.log" 2> "$out/$1/stderr.log"
  echo "$(date +%T) $1: rc=$? in $((SECONDS - start)) s"
  grep -h "KV pool of" "$out/$1/stderr.log" | head -2
  grep -E "^\|" "$out/$1/stdout.log" | tail -4
}
[ -n "${SKIP_ONE_CALL:-}" ] || run one-call 200 "$serve --no-enable-chunked-prefill" "one call"
for c in $CHUNKS; do run "chunked-$c" "${CHUNK_LIMIT:-420}" "$serve --max-num-batched-tokens $c" "chunks of $c"; done
python3 -m server.cli bench merge "$out"/*/results.json --output-dir "$out/merged" > /dev/null 2>&1
grep -E "^\|" "$out"/merged/*.md 2>/dev/null | head -12

#!/usr/bin/env bash
# The project's GPU runs, one driver: on a GPU machine, from a copy of the working tree,
#
#   [KNOB=value ...] bash scripts/gpu.sh PART [ARGS...]      bash scripts/gpu.sh help: the parts and knobs
#
# The parts and their knobs are documented in ONE place, scripts/README.md ("scripts/gpu.sh"; `help`
# prints that section). How the wheels and flash-attn-4 reach the GPU machine, and which device call
# carries what: scripts/README.md, "Device calls".
#
# Every part runs under one header: the wheels (.whl/) and flash-attn-4 (.fa4a/, .fa4b/) installed into
# /tmp/site from whatever the call carried (skipped once installed), PYTHONPATH (CuTe-DSL's packages,
# /tmp/site, the tree), NVLink multicast kept off, results under $out ($OUT on the device machine),
# $out/env.txt (date, the part and its knobs, GPUs, commit, torch and flash-attn-4 versions), and on exit
# everything under $out packed into $out/results.tgz (the device tool brings back at most 8 files).
# KIND=cpu: a dry run on this machine's CPU (nothing installed; the parts that take it run on CPU workers).
# DRY=N: print every command instead of running it, as on N GPUs (nothing installed or measured).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
me=scripts/gpu.sh
KIND=${KIND:-cuda}
site=/tmp/site
out=${OUT:-/tmp/burstserve-gpu}
# parts whose figures rest on flash-attn-4: they stop (exit 3) without it, the others fall back to cuDNN
NEEDS_FA4="kernels decode prefix fp8 fp8attn profile 8x regress"

usage() {
  awk '/^## `scripts\/gpu.sh`/ {p = 1; print; next} p && /^## / {exit} p' scripts/README.md
  echo "Device calls (carry, wheels, flash-attn-4 in two halves, 64 MiB): scripts/README.md, \"Device calls\"."
}

# ---------------------------------------------------------------- header

fa4_ready() { [ -d "$site/flash_attn/cute" ]; }

# install what this call carried: .fa4a (flash-attn-4's first half, kept in /tmp/fa4 for the next call; .fa4c
# likewise, where scripts/fa4_split_three.sh cut the second half again),
# .whl (the wheels the GPU image lacks), .fa4b (the second half and the other wheels: joined and installed)
install_carried() {
  if ! fa4_ready; then       # .fa4a's part, and .fa4c's where flash-attn-4 travels in three calls
    for p in .fa4a/part.* .fa4c/part.*; do
      [ -f "$p" ] && { mkdir -p /tmp/fa4 && cp "$p" /tmp/fa4/ || exit 3; }
    done
  fi
  if [ -z "${SKIP_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
    local have
    have=$(cd .whl && ls -- *.whl)
    if [ "$(cat "$site/.whl-installed" 2>/dev/null)" != "$have" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl 2>&1 \
          | grep -v "^WARNING: Target directory"
      [ "${PIPESTATUS[0]}" = 0 ] || exit 1
      mkdir -p "$site" && echo "$have" > "$site/.whl-installed"
      echo "wheels (.whl) installed into $site" >&2
    fi
  fi
  if [ -d .fa4b ]; then
    bash .fa4b/install.sh || exit 3
  fi
  if [ -f .fa3/install.sh ]; then       # FlashAttention-3's forward (fa3-fwd), for measurements beside ours
    bash .fa3/install.sh || exit 3
  fi
  if ! fa4_ready; then
    if [ -f /tmp/fa4/part.aa ]; then
      echo "flash-attn-4: first half in /tmp/fa4; the next call (within ~30 s) carries .fa4b" >&2
    else
      echo "flash-attn-4 is not installed (carry .fa4a, then .fa4b: scripts/README.md, \"Device calls\")" >&2
    fi
    if [[ " $NEEDS_FA4 " == *" $part "* ]]; then
      echo "$part needs flash-attn-4: stopping" >&2
      exit 3
    fi
    [ "$part" = install ] || echo "attention falls back to cuDNN" >&2
  fi
  [ -d "$site/fastapi" ] || echo "the wheels (.whl: fastapi, uvicorn, openai...) are not installed: serving steps fail" >&2
}

# what this run was: date, the part and every knob set, GPUs, commit, versions
env_txt() {
  local k
  date -u
  echo "part: $part${*:+ $*}"
  for k in $(grep -o '\${[A-Z][A-Z0-9_]*' "$me" | cut -c3- | sort -u); do
    case $k in PIPESTATUS | BASH_SOURCE) continue ;; esac
    [ -z "${!k+x}" ] || echo "$k=${!k}"
  done
  if [ "$KIND" = cuda ]; then
    nvidia-smi -L
    nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
  fi
  git log -1 --format="commit %h (%cI)" 2>/dev/null || echo "commit: unknown (no .git in this copy)"
  python3 - <<'EOF'
import torch
print("torch", torch.__version__)
try:
    import flash_attn.cute as c
    print("flash_attn.cute", c.__version__)
except Exception as e:
    print("flash-attn-4: not importable:", type(e).__name__)
EOF
}

# $out into one archive, $out/results.tgz (the device tool brings back at most 8 files, 2 folders down)
pack() { tar czf /tmp/results.tgz --exclude='*.png' -C "$out" . && rm -rf "${out:?}"/* && mv /tmp/results.tgz "$out/"; }

dry_run() {   # DRY=N: each command printed (on fd 9, the script's stdout past every redirection), as on N GPUs
  exec 9>&1
  show() {
    local e
    e=$(env | grep -E '^(CUDA_VISIBLE_DEVICES|BURSTSERVE_[A-Z0-9_]*|CP|MODEL|LAYERS|CHUNK|DEVICE)=' | sort | tr '\n' ' ')
    echo "+ $e$(printf '%q ' "$@")" >&9
  }
  python3() { show python3 "$@"; }
  timeout() { shift; "$@"; }
  nvidia-smi() { local i; if [ "${1:-}" = -L ]; then for ((i = 0; i < DRY; i++)); do echo "GPU $i: (dry run)"; done; fi; }
  curl() { :; }
  kill() { :; }
  install_carried() { :; }
}

# ---------------------------------------------------------------- helpers

has() { [[ " $sel " == *" $1 "* ]]; }   # is step $1 among the part's chosen steps ($sel, from PARTS)?

# bench NAME LIMIT ARGS...: `python3 -m burstserve.clients.bench ARGS --output-dir $out/NAME`, in its own process under a
# timeout of LIMIT s (stdout.log, stderr.log beside its results.json); then a status line, the last $_rows (8)
# lines of its tables (or the lines matching $_pick), stderr's last lines when it failed. $_visible:
# CUDA_VISIBLE_DEVICES for it. Returns its exit status.
bench() {
  local name=$1 limit=$2; shift 2
  local dir=$out/$name start=$SECONDS rc
  mkdir -p "$dir"
  if [ -n "${_visible:-}" ]; then local -x CUDA_VISIBLE_DEVICES=$_visible; fi
  local module=burstserve.clients.bench
  [ -d burstserve ] || module=clients.bench      # an older tree (regress's base) before the one package
  timeout "$limit" python3 -m "$module" "$@" --output-dir "$dir" > "$dir/stdout.log" 2> "$dir/stderr.log"
  rc=$?
  echo "$(date +%T) $name: rc=$rc in $((SECONDS - start)) s"
  if [ -n "${_pick:-}" ]; then grep -E "$_pick" "$dir/stdout.log"; else grep -E "^\|" "$dir/stdout.log" | tail -"${_rows:-8}"; fi
  [ $rc = 0 ] || grep -v -i warn "$dir/stderr.log" | tail -5
  return $rc
}

# offline NAME LIMIT WORKERS ARGS...: one `bench sweep --offline` on WORKERS workers of $KIND, labelled NAME
offline() {
  local name=$1 limit=$2 workers=$3; shift 3
  _rows=6 bench "$name" "$limit" sweep --offline --devices "$KIND" -cp "$workers" "$@" --label "$name"
}

# ---------------------------------------------------------------- parts

part_install() {   # the header alone: the first device call(s), or a check of what is installed
  :
}

part_run() {   # run CMD...: any command under the header, its output in $out/run.log
  [ $# -gt 0 ] || { echo "usage: $me run COMMAND [ARGS...]" >&2; return 2; }
  "$@" 2>&1 | tee "$out/run.log"
}

part_check() {   # the kernel GPU tests and the engine's GPU tests (-k $K)
  [ -n "${SKIP_KERNELS:-}" ] || timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short -m gpu \
      tests/gpu/test_kernels_gpu.py 2>&1 | tail -30 | tee "$out/kernels.log"
  # pytest-timeout (on the GPU image) stops between tests, so its session limit leaves room for the longest test
  # (40-130 s: an engine's start and transformers' reference) before `timeout` cuts the report
  local limit=${ENGINE_LIMIT:-400} stop=()
  python3 -c "import pytest_timeout" 2>/dev/null && stop=(--session-timeout $((limit - 150)))
  timeout "$limit" python3 -m pytest -q -s -p no:cacheprovider -p no:warnings --tb=short -m gpu "${stop[@]}" \
      tests/gpu/test_gpu.py -k "${K:-one_gpu or cuda_graphs or small_chunk or chunks_and_prefix}" -rA 2>&1 \
      | grep -v -i "warn" | tee "$out/engine.log" | tail -60   # the whole log kept: a cut run's first outcomes
}

part_kernels() {   # kernels/ checked (tests/gpu/test_kernels_gpu.py), then scripts/gpu_kernel_timing.py
  [ -n "${SKIP_TESTS:-}" ] || timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py \
      2>&1 | tee "$out/pytest.log"
  timeout 200 python3 scripts/gpu_kernel_timing.py ${SKIP_BLOCKS:+--no-blocks} 2>&1 | tee "$out/timing.txt"
}

# decode_bench NAME LIMIT ARGS...: one offline decode configuration (llama3-8b, OUTPUT_LEN tokens)
decode_bench() {
  local name=$1 limit=$2; shift 2
  _rows=4 bench "$name" "$limit" sweep --offline --model llama3-8b --devices cuda -cp "${_cp:-${CP:-1}}" \
      --output-len "${OUTPUT_LEN:-128}" --repeats 1 --warmup 1 "$@"
}

# decode_sweep SUFFIX ARGS...: the engine's four decode configurations, ARGS added, SUFFIX on names and labels
decode_sweep() {
  local s=$1; shift
  decode_bench "engine-1x8K$s" "${FIRST_LIMIT:-50}" --lengths 8192 --label "engine, ${CP:-1} GPU, 1 stream$s" "$@"
  decode_bench "engine-1x128K$s" 80 --lengths 131072 --label "engine, ${CP:-1} GPU, 1 stream$s" "$@"
  decode_bench "engine-16x8K$s" 120 --lengths 8192 --batch 16 --label "engine, ${CP:-1} GPU, 16 streams$s" "$@"
  decode_bench "engine-64x2K$s" 120 --lengths 2048 --batch 64 --label "engine, ${CP:-1} GPU, 64 streams$s" "$@"
}

# decode_load NAME LIMIT SERVE_ARGS...: `bench load` (48 x 8K prompts, 128 out, concurrency 16) on a server
decode_load() {
  local name=$1 limit=$2; shift 2
  _pick="^\| (completed|failed|duration|output_throughput|(mean|median|p99)_(ttft|tpot|itl)_ms) " \
  bench "$name" "$limit" load --serve "--model llama3-8b --devices cuda -cp ${CP:-1} $*" \
      --num-prompts 48 --input-len 8192 --output-len 128 --max-concurrency 16 --label "$name"
}

part_decode() {   # decode: GPU tests, paged-decode kernel table, TPOT and tokens/s against transformers, HTTP load
  sel=${PARTS:-tests kernels sweep}
  [ -n "${SKIP_TESTS:-}" ] || ! has tests || timeout "${TEST_LIMIT:-130}" python3 -m pytest -q -p no:cacheprovider \
      -m gpu tests/gpu/test_gpu.py -k "one_gpu or cuda_graphs" 2>&1 | tail -40 | tee "$out/pytest.log"
  if has kernels; then
    timeout 80 python3 scripts/gpu_kernel_timing.py --no-blocks > "$out/kernels.log" 2>&1
    grep -A12 "paged decode, one layer" "$out/kernels.log"; grep -A5 "num_chunks sweep" "$out/kernels.log"
  fi
  # half: the four configurations at half their context on one GPU, what each of 2 workers reads per step
  # (all the weights, half the KV) without the 2-GPU step's per-layer merge: a proxy, not the 2-GPU figure
  if has half; then
    decode_bench "half-1x4K" 50 --lengths 4096 --label "1 GPU, 1 stream, 4K (half of 8K)"
    decode_bench "half-1x64K" 60 --lengths 65536 --label "1 GPU, 1 stream, 64K (half of 128K)"
    decode_bench "half-16x4K" 50 --lengths 4096 --batch 16 --label "1 GPU, 16 streams, 4K (half of 8K)"
    decode_bench "half-64x1K" 50 --lengths 1024 --batch 64 --label "1 GPU, 64 streams, 1K (half of 2K)"
  fi
  if has sweep; then
    decode_sweep ""
    [ -z "${SYNC_AB:-}" ] || decode_sweep "-sync" --no-async-scheduling
    [ -n "${SKIP_PEER:-}" ] || _cp=1 decode_bench transformers-1x 100 --sp-strategy transformers --lengths 8192 \
        --label "transformers static+compile, 1 GPU"
  fi
  if has load; then
    decode_load load-default 200
    [ -z "${SYNC_AB:-}" ] || decode_load load-default-sync 200 --no-async-scheduling
    [ -n "${NO_CHUNKED_LOAD:-}" ] || decode_load load-chunked 200 --max-num-batched-tokens "${LOAD_CHUNK:-2048}" ${LOAD_EXTRA:-}
  fi
}

part_prefix() {   # prefix cache (shared), a long prompt into decoding streams (interference), HTTP overhead (http)
  sel=${PARTS:-shared interference http}
  local long=${LONG:-131072} common sweep target
  local off="--offline --model llama3-8b --devices cuda -cp ${CP:-1}"
  local serve="--model llama3-8b --devices cuda -cp ${CP:-1} ${SERVE_EXTRA:-}"
  if has shared; then
    bench shared-32K 150 shared $off --doc-len 32768 --question-len 512 --questions 4 --repeats 2 --warmup 1
    bench shared-128K 200 shared $off --doc-len "$long" --question-len 512 --questions 3 --repeats 1 --warmup 1
  fi
  if has interference; then
    common="--streams 8 --stream-len 1024 --long-len $long --short-len 1024 --short-delay 0.5 --warmup 1"
    common+=" --repeats ${REPEATS:-1}"
    bench interference-default 330 interference --serve "$serve" $common --label "default flags"
    for target in ${ITL_TARGETS:-}; do
      bench "interference-chunked-itl$target" 260 interference \
          --serve "$serve --max-num-batched-tokens ${CHUNK:-8192} --itl-target-ms $target" \
          $common --label "chunked ${CHUNK:-8192}, itl target $target ms"
    done
    [ "${UNCHUNKED:-1}" = 0 ] || \
    bench interference-unchunked 260 interference --serve "$serve --no-enable-chunked-prefill" $common --label "unchunked"
  fi
  if has http; then
    sweep="--lengths 8192,$long --repeats ${HTTP_REPEATS:-2} --warmup 1"
    bench sweep-offline 150 sweep $off $sweep --label "offline"
    # the server as the offline LLM is (max_model_len = the longest prompt + 1), its request lines at info
    bench sweep-http 170 sweep --serve "$serve --max-model-len $((long + 1)) --log-level info" $sweep --label "HTTP"
    python3 scripts/ttft_parts.py "$out/sweep-http/stderr.log" "$out/sweep-http/results.json" \
        | tee "$out/sweep-http/ttft_parts.md"
  fi
}

# regress_benches SUFFIX: issue 34's no-regression set on the tree in the current folder, SUFFIX on names
regress_benches() {
  local s=$1 long=${LONG:-131072}
  local off="--offline --model llama3-8b --devices cuda -cp 1" serve="--model llama3-8b --devices cuda -cp 1"
  if has decode; then FIRST_LIMIT=${FIRST_LIMIT:-150} decode_sweep "$s"; fi   # the first run on a machine builds kernels
  if has decode8k; then
    decode_bench "engine-1x8K$s" "${FIRST_LIMIT:-150}" --lengths 8192 --label "engine, 1 GPU, 1 stream$s"
  fi
  if has decode16; then
    decode_bench "engine-16x8K$s" 120 --lengths 8192 --batch 16 --label "engine, 1 GPU, 16 streams$s"
  fi
  if has ttft; then
    _rows=5 bench "ttft$s" 200 sweep $off --lengths "${TTFT_LENGTHS:-8192,32768,$long}" --repeats "${TTFT_REPEATS:-2}" --warmup 1 --label "ttft$s"
  fi
  if has shared; then
    bench "shared-128K$s" 300 shared $off --doc-len "$long" --question-len 512 --questions "${QUESTIONS:-3}" \
        --repeats 1 --warmup 1
  fi
  if has interference; then
    bench "interference-default$s" 330 interference --serve "$serve" --streams 8 --stream-len 1024 \
        --long-len "$long" --short-len 1024 --short-delay 0.5 --warmup 1 --repeats "${REPEATS:-1}" \
        --label "default flags$s"
  fi
}

part_regress() {   # the same benchmarks on an older tree (.ab/base.tgz, carried) and on this one, one after the other
  sel=${PARTS:-decode ttft shared interference}
  local here=$PWD base=/tmp/ab-base
  if [ -f .ab/base.tgz ]; then rm -rf "$base" && mkdir -p "$base" && tar xzf .ab/base.tgz -C "$base"; fi
  [ -d "$base/burstserve" ] || [ -d "$base/engine" ] || { echo "$me regress: carry .ab/base.tgz (git archive REV | gzip > .ab/base.tgz)" >&2; return 2; }
  cat .ab/REV "$base/.ab-rev" 2>/dev/null | head -1 | sed 's/^/base tree: /'
  if [ "${ORDER:-}" = this-first ]; then regress_benches "-this"; fi   # the other order: a drift (heat) shows
  (cd "$base" && PYTHONPATH=${PYTHONPATH/%$here/$base} regress_benches "-base")
  if [ "${ORDER:-}" != this-first ]; then regress_benches "-this"; fi
}

# capacity_run NAME LIMIT SERVE_ARGS LABEL: `bench sweep` over HTTP against a server it starts
capacity_run() {
  _rows=4 bench "$1" "$2" sweep --serve "$3" --lengths "${LENGTHS:-131072,524288}" --repeats "${REPEATS:-1}" \
      --warmup "${WARMUP:-0}" --output-len 8 --label "$4"
  grep -h "KV pool of" "$out/$1/stderr.log" | head -2
}

part_capacity() {   # the longest prompt one GPU takes, one call against chunks (TTFT by chunk size)
  [ -n "${SKIP_TESTS:-}" ] || timeout 200 python3 -m pytest -q -s -p no:cacheprovider -p no:warnings --tb=short -m gpu \
      tests/gpu/test_gpu.py -k "pool_holds or one_gpu_matches" 2>&1 | grep -v -i warn | tail -20 | tee "$out/tests.log"
  local serve="--model llama3-8b --devices cuda -cp ${CP:-1} --log-level info" c
  [ -n "${SKIP_ONE_CALL:-}" ] || capacity_run one-call 200 "$serve --no-enable-chunked-prefill" "one call"
  for c in ${CHUNKS:-16384}; do
    capacity_run "chunked-$c" "${CHUNK_LIMIT:-420}" "$serve --max-num-batched-tokens $c" "chunks of $c"
  done
  python3 -m burstserve.clients.bench merge "$out"/*/results.json --output-dir "$out/merged" > /dev/null 2>&1
  grep -E "^\|" "$out"/merged/*.md 2>/dev/null | head -12
}

part_fp8kv() {   # the FP8 KV cache: GPU tests, scripts/gpu_fp8_decode.py, decode and TTFT against bf16 (PARTS)
  sel=${PARTS:-tests table}
  if has tests && [ -z "${SKIP_TESTS:-}" ]; then
    timeout 300 python3 -m pytest -q -s -p no:cacheprovider -p no:warnings --tb=short -m gpu \
        tests/gpu/test_kernels_gpu.py tests/gpu/test_gpu.py -k "fp8_paged_decode or fp8_kv_cache or fp8_kv_round" 2>&1 \
        | grep -v -i "warn\|exe_args" | tail -30 | tee "$out/tests.log"
  fi
  if has table; then
    OUT=$out timeout "${DECODE_LIMIT:-300}" python3 scripts/gpu_fp8_decode.py ${SHAPES:-} 2>&1 | grep -v -i warn \
        | tee "$out/fp8_decode.txt"
  fi
  if has decode; then       # the engine's four decode configurations, bf16 pages then FP8 pages
    FIRST_LIMIT=${FIRST_LIMIT:-150} decode_sweep ""
    FIRST_LIMIT=${FIRST_LIMIT:-150} decode_sweep "-fp8" --kv-cache-dtype fp8
  fi
  if has accuracy; then     # logits and greedy steps against fp32, outlier channels in K; the KV pool by dtype
    OUT=$out timeout "${ACCURACY_LIMIT:-360}" python3 scripts/gpu_fp8_kv_accuracy.py ${ACCURACY_LENGTHS:-8192 32768} \
        2>&1 | grep -v -i warn | tail -12 | tee "$out/accuracy.txt"
    timeout 150 python3 scripts/gpu_kv_capacity.py 2>&1 | grep "^|" | tee "$out/capacity.txt"
  fi
  if has ttft; then         # TTFT at 8K and LONG, bf16 pages then FP8 pages
    local kv
    for kv in auto fp8; do
      _rows=4 bench "ttft-kv-$kv" 200 sweep --offline --model llama3-8b \
          --devices cuda -cp "${CP:-1}" --lengths "8192,${LONG:-131072}" --repeats 1 --warmup 1 --kv-cache-dtype "$kv" \
          --label "kv $kv"
    done
  fi
}

part_hosttier() {   # the KV host tier: GPU tests, copy GB/s, many documents (bench shared), decode gaps during restores
  sel=${PARTS:-tests copy docs streams}
  local off="--offline --model llama3-8b --devices cuda -cp ${CP:-1}" docs=${DOCS:-12} gib=${HOST_GIB:-100}
  if has tests && [ -z "${SKIP_TESTS:-}" ]; then
    timeout 300 python3 -m pytest -q -s -p no:cacheprovider -p no:warnings --tb=short -m gpu tests/gpu/test_gpu.py \
        -k "host_tier" 2>&1 | grep -v -i "warn\|exe_args" | tail -30 | tee "$out/tests.log"
  fi
  if has copy; then
    OUT=$out timeout 200 python3 scripts/gpu_host_tier.py copy 2>&1 | grep -v -i warn | tee "$out/copy.txt"
  fi
  if has docs; then         # DOCS documents of LONG tokens, round robin, FP8 pages (KV_TOKENS: the GPU pool)
    _rows=12 bench "docs-${KV:-fp8}" "${DOCS_LIMIT:-560}" shared $off --kv-cache-dtype "${KV:-fp8}" \
        --kv-offload-gb "$gib" ${KV_TOKENS:+--kv-cache-tokens $KV_TOKENS} --doc-len "${LONG:-131072}" \
        --question-len 512 --documents "$docs" --rounds "${ROUNDS:-3}" --repeats 1 --warmup 0
  fi
  if has gpuhit; then       # one document: cold, then questions from the GPU pool
    _rows=4 bench "gpuhit-${KV:-fp8}" 200 shared $off --kv-cache-dtype "${KV:-fp8}" --kv-offload-gb "$gib" \
        --doc-len "${LONG:-131072}" --question-len 512 --questions 3 --repeats 1 --warmup 1
  fi
  if has streams; then
    OUT=$out timeout "${STREAMS_LIMIT:-400}" python3 scripts/gpu_host_tier.py streams --kv-cache-dtype "${KV:-fp8}" \
        --kv-offload-gb "$gib" --kv-cache-tokens "${STREAM_KV_TOKENS:-262144}" --documents "${STREAM_DOCS:-4}" \
        2>&1 | grep -v -i warn | tail -40 | tee "$out/streams.txt"
  fi
}

part_fp8attn() {   # FP8 attention for prefill (--attention-backend fa3-fp8; .fa3 carried): PARTS tests kernel ttft million
  sel=${PARTS:-tests kernel ttft}
  local name args
  if has tests; then        # the kernel against its torch path (tests/gpu/test_kernels_gpu.py -k fa3)
    timeout 200 python3 -m pytest -q -s -p no:cacheprovider -p no:warnings --tb=short -m gpu \
        tests/gpu/test_kernels_gpu.py -k fa3 2>&1 | grep -v -i "warn\|exe_args" | tail -20 | tee "$out/tests.log"
  fi
  if has kernel; then       # error against float64 as the keys grow, speed against flash-attn-4, kernel vs torch path
    OUT=$out timeout "${KERNEL_LIMIT:-300}" python3 scripts/gpu_fa3_fp8.py 2>&1 | grep -v -i "warn\|exe_args" \
        | tee "$out/fa3_fp8.txt"
  fi
  if has ttft; then         # TTFT: bf16, FP8 pages and linears, the same with FP8 attention (chunked, one call)
    for name in ${CONFIGS:-bf16 fp8 fp8-attention fp8-attention-one-call}; do
      case $name in
        bf16) args="" ;;
        fp8) args="--kv-cache-dtype fp8 -q fp8" ;;
        fp8-attention) args="--kv-cache-dtype fp8 -q fp8 --attention-backend fa3-fp8" ;;
        fp8-attention-one-call) args="--kv-cache-dtype fp8 -q fp8 --attention-backend fa3-fp8 --no-enable-chunked-prefill" ;;
        *) echo "CONFIGS: bf16 fp8 fp8-attention fp8-attention-one-call" >&2; return 2 ;;
      esac
      _rows=4 bench "ttft-$name" 240 sweep --offline --model llama3-8b --devices cuda -cp "${CP:-1}" \
          --lengths "${LENGTHS:-8192,131072}" --repeats "${REPEATS:-2}" --warmup 1 $args --label "$name"
    done
  fi
  if has million; then      # 1,048,576 tokens with FP8 attention: TTFT, then 64 tokens' TPOT
    _rows=4 bench million "${MILLION_LIMIT:-560}" sweep --offline --model llama3-8b --devices cuda -cp "${CP:-1}" \
        --lengths 1048576 --output-len 64 --repeats 1 --warmup 0 --kv-cache-dtype fp8 -q fp8 \
        --attention-backend fa3-fp8 --label fp8-attention
  fi
}

part_fp8() {   # FP8: GPU tests, accuracy and forward time against bf16 (scripts/gpu_fp8.py), TTFT sweep
  [ -n "${SKIP_TESTS:-}" ] || timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -s -p no:cacheprovider -p no:warnings \
      -m gpu tests/gpu/test_gpu.py -k fp8 2>&1 | grep -v -i warn | tail -20 | tee "$out/pytest.log"
  OUT=$out timeout 200 python3 scripts/gpu_fp8.py ${FP8_LENGTHS:-8192 16384} 2>&1 | grep -v -i warn | tail -8 \
      | tee "$out/fp8.log"
  if [ -n "${SWEEP:-}" ]; then
    local q
    for q in ${SWEEP_QUANT:-none fp8}; do
      _rows=5 bench "sweep-$q" 240 sweep --offline --model llama3-8b --devices cuda -cp "${CP:-1}" \
          --lengths "${SWEEP_LENGTHS:-8192,32768,131072}" --repeats 2 --warmup 1 --quantization "$q"
    done
  fi
}

part_zero() {   # burst-zero (BurstAttention + ZeRO) on 2+ GPUs: tests, 8b, short, 70b
  sel=${PARTS:-tests 8b short 70b}
  local cp=${CP:-2} s short
  if has tests; then
    timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu \
        -k "(every_strategy and burst-zero) or measures_which_prompts" 2>&1 \
        | grep -E "logit diff|passed|failed|Error" | tee "$out/tests.log"
  fi
  if has 8b; then
    for s in burst-zero burst; do
      offline "8b-$s" 240 "$cp" --model llama3-8b --sp-strategy "$s" --lengths 8192,32768,131072 --output-len 64 \
          --repeats 2 --warmup 1
    done
    python3 -m burstserve.clients.bench merge "$out"/8b-*/results.json --output-dir "$out/merged-8b" > /dev/null
  fi
  if has short; then
    short="--model llama3-8b --lengths 1024,2048,4096,8192 --repeats 3 --warmup 1"
    BURSTSERVE_LOG_LEVEL=INFO offline "short-burst-zero" 200 "$cp" $short --sp-strategy burst-zero
    grep -h "run on the weight slices" "$out/short-burst-zero/stderr.log" | head -2
    offline "short-burst-zero-gathered" 200 "$cp" $short --sp-strategy burst-zero --zero-sliced-max-tokens 0
    offline "short-burst" 200 "$cp" $short --sp-strategy burst
    python3 -m burstserve.clients.bench merge "$out"/short-*/results.json --output-dir "$out/merged-short" > /dev/null
  fi
  if has 70b; then
    for s in ${STRATEGIES_70B:-burst-zero tp tp-v3}; do
      offline "70b-$s" "${LIMIT_70B:-280}" "$cp" --model llama3-70b --sp-strategy "$s" --lengths "${LONG_70B:-131072}" \
          --output-len 16 --repeats 1 --warmup 0
    done
    # one GPU: its weights alone exceed the GPU, shown as OOM
    _rows=3 bench 70b-transformers 200 sweep --offline --model llama3-70b \
        --devices "$([ "$KIND" = cuda ] && echo cuda:0 || echo "$KIND")" --sp-strategy transformers \
        --lengths "${LONG_70B:-131072}" --repeats 1 --warmup 0 --label "transformers, 1 GPU"
    python3 -m burstserve.clients.bench merge "$out"/70b-*/results.json --output-dir "$out/merged-70b" > /dev/null
  fi
}

part_strategies() {   # every prefill strategy on 2 GPUs: bf16 exactness against transformers, one merged sweep table
  timeout 170 python3 -m pytest -q -s -m gpu tests/gpu -k every_strategy 2>&1 \
      | grep -E "logit diff|passed|failed|Error" | tee "$out/strategies_tests.log"
  local results=() s
  for s in ${STRATEGIES:-burst burst-nolao ring-rsa ulysses cqs tp tp-v3 burst-zero}; do
    _rows=0 bench "$s" 60 sweep --offline --model "${MODEL:-llama3-8b}" --devices cuda -cp 2 --sp-strategy "$s" \
        --lengths "${LENGTHS:-16384,65536}" --repeats 1 --label "$s, 2 GPU" && results+=("$out/$s/results.json")
  done
  python3 -m burstserve.clients.bench merge "${results[@]}" --output-dir "$out/merged"
}

# bench_sweep NAME MODEL WORKERS VISIBLE LIMIT ARGS...: one prefill table configuration under $out/MODEL/NAME,
# WORKERS workers on the first WORKERS visible devices, VISIBLE (if set) restricting the GPUs it sees
bench_sweep() {
  local name=$1 model=$2 workers=$3 visible=$4 limit=$5; shift 5
  _visible=$visible _rows=0 bench "$model/$name" "$limit" sweep --offline --model "$model" --devices "$KIND" \
      -cp "$workers" --repeats "${REPEATS:-2}" --warmup 1 "$@"
}

part_bench() {   # the prefill tables of docs/benchmarks.md: bench small-counts | strategies MODEL... | backends MODEL...
  local lengths=${LENGTHS:-4096,8192,16384,32768,65536,131072,262144} limit=${LIMIT:-170}
  local strategies=${STRATEGIES:-burst auto torch-cp tp tp-v3 burst-zero ulysses cqs burst-nolao ring-rsa}
  local models=${MODELS:-llama3-8b llama2-7b} gpus model s b i visible pids
  if [ "$KIND" = cuda ]; then gpus=$(nvidia-smi -L | wc -l); else gpus=4; fi
  echo "$(date +%T) $KIND x $gpus; models: $models; lengths: $lengths"
  case "${1:-}" in
    small-counts)
      i=0 pids=()
      for model in $models; do   # 1 GPU: two runs per model at once, one GPU each
        bench_sweep transformers-1 "$model" 1 "$([ "$KIND" = cuda ] && echo $i)" "${LIMIT_ONE:-330}" \
            --sp-strategy transformers --lengths "$lengths" --label "transformers, 1 GPU" & pids+=($!)
        bench_sweep single-1 "$model" 1 "$([ "$KIND" = cuda ] && echo $((i + 1)))" "${LIMIT_ONE:-330}" \
            --sp-strategy single --lengths "$lengths" --label "engine (single), 1 GPU" & pids+=($!)
        i=$((i + 2))
      done
      wait "${pids[@]}"
      i=0 pids=()
      for model in $models; do   # 2 GPUs: one pair of GPUs per model
        visible=$([ "$KIND" = cuda ] && echo "$i,$((i + 1))")
        (for s in $strategies; do
           bench_sweep "$s-2" "$model" 2 "$visible" "$limit" --sp-strategy "$s" --lengths "${SCALING_LENGTH:-65536}" \
               --label "$s, 2 GPU"
         done) & pids+=($!)
        i=$((i + 2))
      done
      wait "${pids[@]}" ;;
    strategies)
      shift
      for model in "$@"; do
        for s in $strategies; do
          bench_sweep "$s-$gpus" "$model" "$gpus" "" "$limit" --sp-strategy "$s" --lengths "$lengths" \
              --label "$s, $gpus GPU"
        done
        bench_sweep "burst-nolap-$gpus" "$model" "$gpus" "" "$limit" --sp-strategy burst --no-overlap \
            --lengths "${OVERLAP_LENGTHS:-32768,131072}" --label "burst, no overlap, $gpus GPU"
      done ;;
    backends)
      shift
      for model in "$@"; do
        for b in flash-attn cudnn; do
          bench_sweep "burst-$b-$gpus" "$model" "$gpus" "" "$limit" --sp-strategy burst --attention-backend "$b" \
              --lengths "${BACKEND_LENGTHS:-8192,32768,131072}" --label "burst, $b, $gpus GPU"
        done
      done ;;
    *) echo "usage: $me bench small-counts | strategies MODEL... | backends MODEL..." >&2; return 2 ;;
  esac
}

part_cp() {   # the prefill on CP GPUs under default flags against unchunked, tp, torch-cp, two GPUs and one (issue 49)
  sel=${PARTS:-engine long peers one}
  local cp=${CP:-2} m=${MODEL:-llama3-8b} limit=${LIMIT:-240} results=() name
  local sweep="--model $m --lengths ${LENGTHS:-8192,32768,131072} --repeats ${REPEATS:-1} --warmup 1"
  local long="--model $m --lengths ${LONG:-262144} --repeats 1 --warmup 0"
  add() { [ -f "$out/$1/results.json" ] && results+=("$out/$1/results.json"); }
  if has engine; then
    offline "default-$cp" "$limit" "$cp" $sweep; add "default-$cp"
    offline "unchunked-$cp" "$limit" "$cp" $sweep --no-enable-chunked-prefill; add "unchunked-$cp"
  fi
  if has long; then   # past one default chunk: LONG in chunks against one call
    offline "default-$cp-long" "$limit" "$cp" $long; add "default-$cp-long"
    offline "unchunked-$cp-long" "$limit" "$cp" $long --no-enable-chunked-prefill; add "unchunked-$cp-long"
  fi
  if has passkv; then   # LONG in chunks whose extends pass the cached K/V (--extend-pass kv), beside pass-Q's
    offline "default-$cp-long" "$limit" "$cp" $long; add "default-$cp-long"
    offline "passkv-$cp-long" "$limit" "$cp" $long --extend-pass kv; add "passkv-$cp-long"
  fi
  if has peers; then
    for name in ${PEERS:-tp torch-cp}; do
      offline "$name-$cp" "$limit" "$cp" $sweep --sp-strategy "$name"; add "$name-$cp"
    done
  fi
  if has two && [ "$cp" -gt 2 ]; then offline "engine-2" "$limit" 2 $sweep; add "engine-2"; fi   # the first 2 GPUs
  if has one; then offline "engine-1" "${LIMIT_ONE:-$limit}" 1 $sweep; add "engine-1"; fi
  [ ${#results[@]} = 0 ] || python3 -m burstserve.clients.bench merge "${results[@]}" --output-dir "$out/merged" \
      | grep -E "^\|" | tee "$out/merged.md"
}

part_8x() {   # 8 GPUs: one 1M-token prompt end to end (million), the 4-GPU column of the scaling table (scaling)
  local gpus=${GPUS:-8} model=${MODEL:-llama3-8b} n=${MILLION:-1048576} m s
  case "${PARTS:-million}" in
    million)
      offline "burst-$gpus-million" 420 "$gpus" --model "$model" --lengths "$n" --output-len 64 --repeats 1 --warmup 0
      offline "torch-cp-$gpus-million" 170 "$gpus" --model "$model" --sp-strategy torch-cp --lengths "$n" \
          --repeats 1 --warmup 0 ;;
    scaling)
      for m in ${MODELS:-llama3-8b llama2-7b}; do
        for s in burst auto torch-cp; do
          offline "$m/$s-4" 150 4 --model "$m" --sp-strategy "$s" --lengths 65536,131072 --repeats 1 --warmup 1
        done
      done ;;
    *) echo "PARTS: million | scaling" >&2; return 2 ;;
  esac
}

part_final() {   # end of session on all GPUs: GPU tests, the server answering streaming 32K prompts
  echo "GPUs: $(nvidia-smi -L | wc -l)"
  [ -n "${SKIP_TESTS:-}" ] || timeout 360 python3 -m pytest -q -m gpu tests/gpu 2>&1 | tail -3 | tee "$out/gpu_tests.log"
  python3 -m burstserve.server.cli serve --model llama3-8b --devices cuda --port 8000 --log-level info > "$out/server.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
  # the same length three times, then three new lengths once each: what a new prompt length costs
  timeout 150 python3 -m burstserve.clients.ttft_probe --url http://127.0.0.1:8000 --prompt-tokens 32768 --vocab 128256 \
      --repeats 3 2>&1 | tee "$out/server_ttft.json"
  timeout 150 python3 -m burstserve.clients.ttft_probe --url http://127.0.0.1:8000 --prompt-tokens 32769,32770,32771,32768 \
      --vocab 128256 --repeats 1 2>&1 | tee -a "$out/server_ttft.json"
  curl -s http://127.0.0.1:8000/metrics | grep -E "^burstserve:(request_prefill_time_seconds_(sum|count)|ring_exchange_hidden_fraction_(sum|count)|time_to_first_token_seconds_(sum|count))" \
      | tee -a "$out/server_ttft.json"
  kill -TERM $server; wait $server
  grep -E "kernel|listening|Shutting|shutting" "$out/server.log" | head -5
}

part_profile() {   # profile decode | prefill: where a step's time goes (markdown tables)
  local what=${1:-} ctx
  case "$what" in
    decode)
      for ctx in ${CONTEXTS:-8192 131072}; do
        # CP=G SP=strategy (environment): on G GPUs, one process each; KIND=cpu: on CPU workers
        DEVICE=${DEVICE:-$KIND} timeout 200 python3 scripts/gpu_decode_profile.py "$ctx" 2>&1 | grep -v -i "warn\|exe_args" \
            | tee "$out/profile_$ctx.txt"
      done ;;
    prefill)
      CP=${CP:-1} DEVICE=${DEVICE:-$KIND} timeout 540 python3 scripts/gpu_prefill_profile.py "${LENGTHS:-8192,32768,131072}" \
          2>&1 | grep -v -i "warn\|exe_args" | tee "$out/prefill_profile.txt" ;;
    *) echo "usage: $me profile decode | prefill" >&2; return 2 ;;
  esac
}

# ---------------------------------------------------------------- main

part=${1:-}
case "$part" in
  "" | help | -h | --help) usage; [ -n "$part" ]; exit ;;
esac
if ! declare -F "part_$part" >/dev/null; then
  echo "$me: no part '$part'; the parts: $(declare -F | sed -n 's/^declare -f part_//p' | tr '\n' ' ')" >&2
  echo "(bash $me help; scripts/README.md)" >&2
  exit 2
fi
shift
[ -z "${DRY:-}" ] || dry_run
[ "$KIND" != cuda ] || install_carried
if [ "$KIND" = cuda ]; then
  export PYTHONPATH=$site/nvidia_cutlass_dsl/dsl_packages:$site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out" || exit 2
if [[ "$(cd "$out" && pwd)" =~ ^($PWD|/|$HOME)$ ]] || [ -n "$(git ls-files -- "$out" 2>/dev/null | head -1)" ]; then
  echo "$me: OUT=$out: pack empties it; give a folder of its own" >&2; exit 2
fi
trap pack EXIT
env_txt "$@" 2>&1 | tee "$out/env.txt"
"part_$part" "$@"

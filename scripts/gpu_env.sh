# Sourced by the GPU scripts: the wheels the GPU image lacks (.whl/, from ../shared/gpu/prepare.sh),
# the project on PYTHONPATH, NVLink multicast kept off, and $out for results ($OUT on the device machine).
out=${OUT:-/tmp/burstserve-gpu}
mkdir -p "$out"
if [ -z "${SKIP_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then   # SKIP_WHEELS=1: a CPU dry run here
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the device tool brings back at most 8 files from $OUT: call `pack` last to turn $out into one archive
pack() { tar czf /tmp/results.tgz --exclude='*.png' -C "$out" . && rm -rf "${out:?}"/* && mv /tmp/results.tgz "$out/"; }

# offline_sweep NAME LIMIT DEVICES WORKERS ARGS...: one `bench sweep --offline` in its own process, under
# $out/NAME (its results.json for `burstserve bench merge`), then a status line and its table
offline_sweep() {
  local name=$1 limit=$2 devices=$3 workers=$4; shift 4
  local start=$SECONDS
  mkdir -p "$out/$name"
  timeout "$limit" python3 -m server.cli bench sweep --offline --devices "$devices" -cp "$workers" "$@" --label "$name" \
      --output-dir "$out/$name" > "$out/$name/stdout.log" 2> "$out/$name/stderr.log"
  local rc=$?
  echo "$(date +%T) $name: rc=$rc in $((SECONDS - start)) s"
  [ $rc = 0 ] || grep -v -i warn "$out/$name/stderr.log" | tail -4
  grep -E "^\|" "$out/$name/stdout.log" | tail -6
}

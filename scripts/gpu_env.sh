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

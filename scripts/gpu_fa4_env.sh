# Sourced by the GPU scripts that use flash-attn-4, in the second of their two device calls: installs it from
# .fa4b where it was carried (see ../shared/gpu/fa4-prepare.sh; without it `auto` attention falls back to
# cuDNN, said on stderr; KIND=cpu, a script's dry run here, skips it), sources gpu_env.sh ($out, the wheels,
# `pack`), puts CuTe-DSL's packages on PYTHONPATH, packs $out on exit and writes $out/env.txt (time, GPUs, commit).
if [ "${KIND:-cuda}" != cuda ]; then :
elif [ -d .fa4b ]; then bash .fa4b/install.sh || exit 3
else echo "flash-attn-4 was not carried (.fa4b): attention falls back to cuDNN" >&2
fi
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
trap pack EXIT
{ date -u; [ "${KIND:-cuda}" != cuda ] || nvidia-smi -L; git log -1 --format=%h 2>/dev/null; } 2>&1 | tee "$out/env.txt"

# session probe 4 (issue 53): the casts' lengths not specialized: GPU tests, a new prompt length's first prefill
R=$OUT
g() { local d=$1; shift; mkdir -p $R/$d; OUT=$R/$d timeout ${LIM:-200} bash scripts/gpu.sh run "$@" 2>&1 | grep -v -i "warn\|exe_args" | tail -${TAIL:-60}; }
TAIL=2 g tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py -k "fa3 or turn_the_rows"
KV=fp8 QUANT=fp8 KERNEL=fa3_fp8 TAIL=30 g p8k-fa3 python3 scripts/gpu_prefill_profile.py 8192

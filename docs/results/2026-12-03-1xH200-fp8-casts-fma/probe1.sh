# session probe 1 (issue 53): the casts' division by two FMAs and one pipeline stage (this tree): GPU tests; the casts'
# variants and launches (scripts/probe_casts.py); FA3's pack_gqa at 16K-64K; the 8K prefill's profile with FP8 attention
R=$OUT; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
g() { local d=$1; shift; mkdir -p $R/$d; OUT=$R/$d timeout ${LIM:-200} bash scripts/gpu.sh run "$@" 2>&1 | grep -v -i "warn\|exe_args" | tail -${TAIL:-60}; }
LIM=200 TAIL=8 g tests python3 -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py -k "fa3 or turn_the_rows or few_rows"
LIM=150 TAIL=30 g casts python3 scripts/probe_casts.py 8192 131072
LIM=60 TAIL=12 g fa3 python3 scripts/probe_fa3_knobs.py 16384 32768 65536
KV=fp8 QUANT=fp8 KERNEL=fa3_fp8 LIM=150 TAIL=24 g p8k python3 scripts/gpu_prefill_profile.py 8192

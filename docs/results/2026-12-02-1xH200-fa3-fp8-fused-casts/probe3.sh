# session probe 3 (issue 53): the casts as persistent loops, FP8 from 2^24 pairs: tests, speed, 8K profile, TTFT
R=$OUT; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
g() { local d=$1; shift; mkdir -p $R/$d; OUT=$R/$d timeout ${LIM:-200} bash scripts/gpu.sh run "$@" 2>&1 | grep -v -i "warn\|exe_args" | tail -${TAIL:-60}; }
TAIL=6 g tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py -k "fa3 or turn_the_rows"
TAIL=8 g speed env SPEED_LENGTHS=8192,16384 SEGMENTS=131072 python3 scripts/gpu_fa3_fp8.py speed
KV=fp8 QUANT=fp8 KERNEL=fa3_fp8 TAIL=24 g p8k-fa3 python3 scripts/gpu_prefill_profile.py 8192
OUT=$R/ttft PARTS=ttft CONFIGS="bf16 fp8 fp8-attention" LENGTHS=8192,131072 REPEATS=3 timeout 400 bash scripts/gpu.sh fp8attn 2>&1 | grep "^|\|rc="

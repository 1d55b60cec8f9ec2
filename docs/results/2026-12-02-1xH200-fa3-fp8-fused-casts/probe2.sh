# session probe 2 (issue 53): the rotation inside the casts: GPU tests, speed by length, 8K profile and TTFT
R=$OUT
g() { local d=$1; shift; mkdir -p $R/$d; OUT=$R/$d timeout ${LIM:-200} bash scripts/gpu.sh run "$@" 2>&1 | grep -v -i "warn\|exe_args" | tail -${TAIL:-60}; }
TAIL=12 g tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py -k "fa3 or turn_the_rows"
TAIL=8 g speed env SPEED_LENGTHS=4096,8192,16384,32768 SEGMENTS=131072 python3 scripts/gpu_fa3_fp8.py speed
sed -i 's/^FP8_MIN_PAIRS = 1 << 28 /FP8_MIN_PAIRS = 0 /' kernels/attention.py
KV=fp8 QUANT=fp8 KERNEL=fa3_fp8 TAIL=30 g p8k-fa3 python3 scripts/gpu_prefill_profile.py 8192
OUT=$R/ttft-all PARTS=ttft CONFIGS="fp8-attention" LENGTHS=8192 REPEATS=5 timeout 150 bash scripts/gpu.sh fp8attn 2>&1 | grep "^|\|rc="
sed -i 's/^FP8_MIN_PAIRS = 0 /FP8_MIN_PAIRS = 1 << 28 /' kernels/attention.py
OUT=$R/ttft-base PARTS=ttft CONFIGS="fp8 fp8-attention" LENGTHS=8192 REPEATS=5 timeout 300 bash scripts/gpu.sh fp8attn 2>&1 | grep "^|\|rc="

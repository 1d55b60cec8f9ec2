# session probe 1 (issue 53): GEMM scaling, 8K attention, 8K prefill profile, 128K decode profile
R=$OUT
g() { local d=$1; shift; mkdir -p $R/$d; OUT=$R/$d timeout ${LIM:-200} bash scripts/gpu.sh run "$@" 2>&1 | grep -v -i "warn\|exe_args" | tail -${TAIL:-60}; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
g gemm python3 scripts/probe_gemm_scaling.py 8192 65536
TAIL=8 g speed env SPEED_LENGTHS=8192,16384 SEGMENTS=131072 python3 scripts/gpu_fa3_fp8.py speed
KV=fp8 QUANT=fp8 g p8k python3 scripts/gpu_prefill_profile.py 8192
sed -i 's/^FP8_MIN_PAIRS = 1 << 28 /FP8_MIN_PAIRS = 0 /' kernels/attention.py
KV=fp8 QUANT=fp8 KERNEL=fa3_fp8 g p8k-fa3 python3 scripts/gpu_prefill_profile.py 8192
sed -i 's/^FP8_MIN_PAIRS = 0 /FP8_MIN_PAIRS = 1 << 28 /' kernels/attention.py
KV=fp8 QUANT=fp8 LIM=240 g d128k python3 scripts/gpu_decode_profile.py 131072

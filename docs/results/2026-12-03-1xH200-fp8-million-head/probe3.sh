# session probe 3 (issue 53): the decode kernel's waves by context; TTFT bf16 / FP8 pages + -q fp8 / + fa3-fp8 at
# 8K and 128K (one call); a 128K decode step's profile
R=$OUT; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
g() { local d=$1; shift; mkdir -p $R/$d; OUT=$R/$d timeout ${LIM:-200} bash scripts/gpu.sh run "$@" 2>&1 | grep -v -i "warn\|exe_args" | tail -${TAIL:-60}; }
LIM=150 TAIL=30 g waves python3 scripts/probe_decode_waves.py 1x131072 16x8192 1x1048576
OUT=$R/ttft PARTS=ttft CONFIGS="bf16 fp8 fp8-attention" LENGTHS=8192,131072 REPEATS=3 timeout 400 bash scripts/gpu.sh fp8attn 2>&1 | grep "^|\|rc="

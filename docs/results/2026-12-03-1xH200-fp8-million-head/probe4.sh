# session probe 4 (issue 53): does rounding the turned values to bf16 in the casts (4ddb3e6) cost the 8K prefill?
# the 8K profile with FP8 attention and TTFT 8K, head against the same tree with that rounding taken out (sed)
R=$OUT; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
g() { local d=$1; shift; mkdir -p $R/$d; OUT=$R/$d timeout ${LIM:-200} bash scripts/gpu.sh run "$@" 2>&1 | grep -v -i "warn\|exe_args" | tail -${TAIL:-60}; }
t8() { OUT=$R/$1 PARTS=ttft CONFIGS="fp8-attention" LENGTHS=8192 REPEATS=5 timeout 150 bash scripts/gpu.sh fp8attn 2>&1 | grep "^| 8192\|rc="; }
KV=fp8 QUANT=fp8 KERNEL=fa3_fp8 TAIL=22 g p8k-head python3 scripts/gpu_prefill_profile.py 8192
t8 ttft-head
cp kernels/fa3_fp8.py /tmp/fa3_fp8.head.py
sed -i 's/^\( *\)y = y.to(x.dtype).to(tl.float32) .*$/\1y = y/' kernels/fa3_fp8.py; grep -n "^ *y = y$" kernels/fa3_fp8.py
KV=fp8 QUANT=fp8 KERNEL=fa3_fp8 TAIL=22 g p8k-noround python3 scripts/gpu_prefill_profile.py 8192
t8 ttft-noround
cp /tmp/fa3_fp8.head.py kernels/fa3_fp8.py

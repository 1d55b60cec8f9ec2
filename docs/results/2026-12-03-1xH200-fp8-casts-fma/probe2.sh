# session probe 2 (issue 53): TTFT bf16 / FP8 pages + -q fp8 / + fa3-fp8 at 8K and 128K, one call (this tree)
R=$OUT; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
OUT=$R/ttft PARTS=ttft CONFIGS="bf16 fp8 fp8-attention" LENGTHS=8192,131072 REPEATS=3 timeout 560 bash scripts/gpu.sh fp8attn 2>&1 | grep "^|\|rc="

# session probe 4 (issue 53): 1,048,576 tokens with FP8 attention (this tree): TTFT and TPOT, 64 tokens out
R=$OUT; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
OUT=$R/million PARTS=million timeout 590 bash scripts/gpu.sh fp8attn 2>&1 | grep "^|\|rc="

# session probe 2 (issue 53): 1,048,576 tokens with FP8 attention (TTFT, 64 tokens' TPOT); clocks and power every 5 s
R=$OUT; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -l 5 > $R/smi.csv &
OUT=$R/million PARTS=million MILLION_LIMIT=560 bash scripts/gpu.sh fp8attn 2>&1 | grep "^|\|rc="
kill %1

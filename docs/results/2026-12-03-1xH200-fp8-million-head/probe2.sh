# session probe 2 (issue 53): 1,048,576 tokens with FP8 attention (the GEMM setting probe 1 kept, if any)
R=$OUT; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
if [ -f /tmp/burst_best_gemm ]; then
  IFS=, read bn bk st wp wv < /tmp/burst_best_gemm
  sed -i "s/block_n=64, block_k=256, stages=3, warps=4, waves=3)/block_n=$bn, block_k=$bk, stages=$st, warps=$wp, waves=$wv)/" kernels/fp8_small_gemm.py
fi
grep -n "^def _launch" kernels/fp8_small_gemm.py
OUT=$R/million PARTS=million MILLION_LIMIT=560 bash scripts/gpu.sh fp8attn 2>&1 | grep "^|\|rc="

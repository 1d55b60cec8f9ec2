# session probe 1 (issue 53): GPU tests; TTFT bf16 / FP8 pages + -q fp8 / + fa3-fp8 at 8K and 128K, one call
R=$OUT; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; git log --oneline -1 2>/dev/null
mkdir -p $R/tests; OUT=$R/tests timeout 150 bash scripts/gpu.sh run python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/gpu/test_kernels_gpu.py -k "fa3 or turn_the_rows or few_rows or fp8_paged_decode" 2>&1 | tail -4
OUT=$R/ttft PARTS=ttft CONFIGS="bf16 fp8 fp8-attention" LENGTHS=8192,131072 REPEATS=3 timeout 400 bash scripts/gpu.sh fp8attn 2>&1 | grep "^|\|rc="

# session probe 3 (issue 53): the division's zeros kept by a select (this tree): where the bytes differed on ties
# (scripts/probe_ties.py: the kernel now, with div.rn, and a plain multiply), then the GPU tests again
R=$OUT; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
g() { local d=$1; shift; mkdir -p $R/$d; OUT=$R/$d timeout ${LIM:-200} bash scripts/gpu.sh run "$@" 2>&1 | grep -v -i "warn\|exe_args" | tail -${TAIL:-60}; }
LIM=100 TAIL=40 g ties python3 scripts/probe_ties.py
LIM=200 TAIL=4 g tests python3 -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py -k "fa3 or turn_the_rows or few_rows"
LIM=60 TAIL=16 g casts python3 scripts/probe_casts.py 8192

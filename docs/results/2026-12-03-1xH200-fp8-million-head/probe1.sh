# session probe 1 (issue 53): GPU tests; the few-rows GEMM's launch settings; TPOT 128K, the best against the default
R=$OUT; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
g() { local d=$1; shift; mkdir -p $R/$d; OUT=$R/$d timeout ${LIM:-200} bash scripts/gpu.sh run "$@" 2>&1 | grep -v -i "warn\|exe_args" | tail -${TAIL:-60}; }
tpot() { local d=$1; shift; mkdir -p $R/$d; OUT=$R/$d timeout 170 bash scripts/gpu.sh run python3 -m clients.bench sweep --offline --model llama3-8b --devices cuda -cp 1 --lengths 131072 --output-len 128 --repeats 2 --warmup 1 --kv-cache-dtype fp8 -q fp8 --label $d --output-dir $R/$d "$@" 2>&1 | grep "^|" | tail -2; }
TAIL=4 g tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py -k "fa3 or turn_the_rows or few_rows"
LIM=240 TAIL=45 g gemm python3 scripts/probe_gemm_launch.py 1 16
best=$(grep -o '^BEST=[0-9,]*' $R/gemm/run.log | cut -d= -f2); echo "best setting: $best"
tpot tpot-default
if [ -n "$best" ] && [ "$best" != "64,256,3,4,3" ]; then
  IFS=, read bn bk st wp wv <<< "$best"
  cp kernels/fp8_small_gemm.py /tmp/fp8_small_gemm.default.py
  sed -i "s/block_n=64, block_k=256, stages=3, warps=4, waves=3)/block_n=$bn, block_k=$bk, stages=$st, warps=$wp, waves=$wv)/" kernels/fp8_small_gemm.py
  grep -n "^def _launch" kernels/fp8_small_gemm.py
  TAIL=3 g tests-best python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_kernels_gpu.py -k "few_rows"
  tpot tpot-best
  cp /tmp/fp8_small_gemm.default.py kernels/fp8_small_gemm.py
  tpot tpot-default-again
  python3 - "$R" "$best" <<'PY'
import json, sys, glob
r, best = sys.argv[1], sys.argv[2]
def tpot(d):
    f = glob.glob(f"{r}/{d}/**/results.json", recursive=True)
    return json.load(open(f[0]))["rows"][0]["mean_tpot_ms"] if f else float("nan")
a, b, c = tpot("tpot-default"), tpot("tpot-best"), tpot("tpot-default-again")
print(f"TPOT 128K ms: default {a:.3f}, best {b:.3f}, default again {c:.3f}")
if b < 0.99 * min(a, c):
    open("/tmp/burst_best_gemm", "w").write(best)
    print("kept for the next calls: /tmp/burst_best_gemm", best)
PY
fi

#!/usr/bin/env bash
# GPU suite for the Triton kernels (issue 4), in one command from the repository root:
#
#     OUT=/some/dir bash loadtest/gpu_suite.sh
#
# 1. the kernel tests on CUDA (compiled, bf16 / fp16 / fp32 variants; the CPU-interpreter
#    variants skip themselves), the quantized-GEMM tests and the CUDA-graph engine tests, in four parallel shards
#    since compiling dominates;
# 2. the kernel benchmarks (loadtest/bench_kernels.py, loadtest/bench_quant_kernels.py),
#    after the tests pass or not;
# 3. the engine benchmark (loadtest/bench_engine_gpu.py) in the time left.
# Logs and the benchmarks' JSON go to $OUT; the last lines printed are the test summaries
# and the benchmark tables. Budget: under 8 minutes on one H200.
set -u
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
start=$(date +%s)

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  "$PY" -c "import torch, triton, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'numpy', numpy.__version__)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfEs --durations=10)
timeout 330 "${PYTEST[@]}" tests/kernels/test_triton_attention.py -k "cuda-bf16" >"$OUT/tests_attention_bf16.log" 2>&1 &
p1=$!
timeout 330 "${PYTEST[@]}" tests/kernels/test_triton_attention.py -k "not cuda-bf16" >"$OUT/tests_attention_other.log" 2>&1 &
p2=$!
timeout 330 "${PYTEST[@]}" tests/kernels/test_triton_cache.py tests/kernels/test_engine_triton.py \
  tests/kernels/test_kernel_dispatch.py tests/kernels/test_triton_compile.py tests/engine/test_cuda_graphs.py \
  >"$OUT/tests_cache_engine.log" 2>&1 &
p3=$!
timeout 330 "${PYTEST[@]}" tests/quantization/test_triton_w4a16.py tests/quantization/test_triton_w8a8.py \
  tests/quantization/test_w8a8.py >"$OUT/tests_quant.log" 2>&1 &
p4=$!
rc=0
for p in $p1 $p2 $p3 $p4; do wait $p || rc=1; done
echo "tests done in $(( $(date +%s) - start )) s (rc $rc)"

timeout 150 "$PY" -m loadtest.bench_kernels --json "$OUT/bench_kernels.json" >"$OUT/bench_kernels.log" 2>&1
brc=$?
timeout 150 "$PY" -m loadtest.bench_quant_kernels --json "$OUT/bench_quant_kernels.json" >"$OUT/bench_quant_kernels.log" 2>&1 || brc=1
echo "bench done in $(( $(date +%s) - start )) s (rc $brc)"

# 3. The engine benchmark (Llama-3-8B shape, random weights) in what is left of the 8
# minutes; it skips the sections that would not fit and prints its table last.
left=$(( 470 - ($(date +%s) - start) ))
erc=0
if [ "$left" -gt 90 ]; then
  timeout "$left" "$PY" -m loadtest.bench_engine_gpu --json "$OUT/bench_engine_gpu.json" --time-budget $(( left - 30 )) \
    >"$OUT/bench_engine_gpu.log" 2>&1 || erc=1
else
  echo "engine benchmark skipped: ${left} s of the 8 minutes left" >"$OUT/bench_engine_gpu.log"
  erc=1
fi
echo "engine bench done in $(( $(date +%s) - start )) s (rc $erc)"

echo
for f in tests_attention_bf16 tests_attention_other tests_cache_engine tests_quant; do
  echo "== $f: $(tail -n 1 "$OUT/$f.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -n 15
done
echo
tail -n 8 "$OUT/bench_kernels.log"
echo
tail -n 12 "$OUT/bench_quant_kernels.log"
echo
sed -n '/^| what /,$p' "$OUT/bench_engine_gpu.log" | grep . || tail -n 20 "$OUT/bench_engine_gpu.log"
exit $(( rc | brc | erc ))

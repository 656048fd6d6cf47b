#!/usr/bin/env bash
# GPU suite in one command from the repository root, well inside one 10-minute run:
#
#     OUT=/some/dir bash loadtest/gpu_suite.sh            # ~8 minutes on one H200
#     OUT=/some/dir bash loadtest/gpu_suite.sh --quick    # ~4 minutes
#
# Phases in order of value, each under its own time budget (BUDGET_FULL / BUDGET_QUICK
# below, seconds; tests/loadtest/test_gpu_suite.py checks they add up):
# 1. tests: CUDA correctness - the Triton kernels compiled (bf16 / fp16 / fp32; attention and
#    cache write on INT8 / FP8 KV caches too), the quantized GEMMs, CUDA graphs, the engine on
#    Triton with quantized linears against its reference, seeded sampling and prompt logprobs -
#    in five parallel shards, since compiling dominates;
# 2. engine: loadtest/bench_engine_gpu.py on a random-weight Llama-3-8B shape: bf16 batch 1
#    and 64 vs Hugging Face `generate`, INT4 and INT8 batch 1 (then prefill and batch 256
#    when the time allows, and where each batch-1 step's kernel time goes; --quick leaves
#    them out);
# 3. kernels: loadtest/bench_kernels.py and loadtest/bench_quant_kernels.py (full run only).
#
# Result files in $OUT (at most 8; the summary first, also printed at the end):
#   00_summary.txt, 10_tests.log, 20_engine.log, 21_engine.json, 30_kernels.log,
#   31_kernels.json, 32_quant_kernels.log, 33_quant_kernels.json
# Needs nothing beyond torch, triton, numpy, transformers, tokenizers, safetensors and pytest
# (the GPU machine starts bare, without network); the test selection avoids tests that need
# the bundled model's packages (checked by tests/loadtest/test_gpu_suite.py).
set -u
BUDGET_FULL="tests=170 engine=220 kernels=80"
BUDGET_QUICK="tests=100 engine=130 kernels=0"

quick=0
case "${1:-}" in
  --quick) quick=1 ;;
  "") ;;
  *) echo "usage: OUT=DIR bash loadtest/gpu_suite.sh [--quick]" >&2; exit 2 ;;
esac
budgets=$BUDGET_FULL
[ "$quick" = 1 ] && budgets=$BUDGET_QUICK
budget() { for kv in $budgets; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done; }

OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
SUMMARY="$OUT/00_summary.txt"
scratch=$(mktemp -d)

{
  echo "gpu_suite $( [ "$quick" = 1 ] && echo --quick ) $(date -u) budgets: $budgets"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>&1
  "$PY" -c "import torch, triton, numpy, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'numpy', numpy.__version__, 'transformers', transformers.__version__)" 2>&1
} >"$SUMMARY"

# ---- 1. CUDA correctness ------------------------------------------------------------------------
T=$(budget tests)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfEs)
QUICK_MARK=()
[ "$quick" = 1 ] && QUICK_MARK=(-m "not slow")
# Shards C and D leave out the slow tier: there it means the bundled model (not on the GPU
# machine) or CPU-interpreter runs, which skip on CUDA anyway.
# tests/kernels/test_triton_kv_quant.py (INT8 / FP8 KV cache) splits by variant like the attention tests.
timeout "$T" "${PYTEST[@]}" ${QUICK_MARK[@]+"${QUICK_MARK[@]}"} tests/kernels/test_triton_attention.py \
  tests/kernels/test_triton_kv_quant.py -k "cuda-bf16" >"$scratch/attention_bf16.log" 2>&1 &
p1=$!
timeout "$T" "${PYTEST[@]}" ${QUICK_MARK[@]+"${QUICK_MARK[@]}"} tests/kernels/test_triton_attention.py \
  tests/kernels/test_triton_kv_quant.py -k "not cuda-bf16" >"$scratch/attention_other.log" 2>&1 &
p2=$!
timeout "$T" "${PYTEST[@]}" -m "not slow" tests/engine/test_cuda_graphs.py tests/kernels/test_engine_triton.py \
  tests/kernels/test_triton_cache.py tests/kernels/test_kernel_dispatch.py tests/engine/test_sampler.py \
  tests/engine/test_prompt_logprobs.py >"$scratch/engine.log" 2>&1 &
p3=$!
# The quantized GEMMs compile a kernel per tile config and dtype: two shards (one took over
# 220 s on an H200 beside the others).
timeout "$T" "${PYTEST[@]}" -m "not slow" tests/quantization/test_triton_w8a16.py \
  tests/quantization/test_triton_w4a16.py >"$scratch/quant_w16.log" 2>&1 &
p4=$!
timeout "$T" "${PYTEST[@]}" -m "not slow" tests/quantization/test_triton_w8a8.py tests/quantization/test_w8a8.py \
  tests/quantization/test_lm_head.py >"$scratch/quant_w8a8.log" 2>&1 &
p5=$!
trc=0
for p in $p1 $p2 $p3 $p4 $p5; do wait $p || trc=1; done
for shard in attention_bf16 attention_other engine quant_w16 quant_w8a8; do
  echo "==================== $shard" >>"$OUT/10_tests.log"
  cat "$scratch/$shard.log" >>"$OUT/10_tests.log"
done
{
  echo
  echo "== 1. tests (rc $trc, $(elapsed) s of the run)"
  for shard in attention_bf16 attention_other engine quant_w16 quant_w8a8; do
    echo "$shard: $(tail -n 1 "$scratch/$shard.log")"
    grep -E "^(FAILED|ERROR)" "$scratch/$shard.log" | head -n 10
  done
} >>"$SUMMARY"

# ---- 2. engine vs HF, bf16 / INT4 / INT8 --------------------------------------------------------
E=$(budget engine)
ENGINE_ARGS=(--json "$OUT/21_engine.json" --time-budget $(( E - 25 )))
[ "$quick" = 1 ] && ENGINE_ARGS+=(--quick) || ENGINE_ARGS+=(--profile)
timeout "$E" "$PY" -m loadtest.bench_engine_gpu "${ENGINE_ARGS[@]}" >"$OUT/20_engine.log" 2>&1
erc=$?
{
  echo
  echo "== 2. engine (rc $erc, $(elapsed) s of the run)"
  sed -n '/^| what /,$p' "$OUT/20_engine.log" | grep . || tail -n 15 "$OUT/20_engine.log"
} >>"$SUMMARY"

# ---- 3. kernel benchmarks -----------------------------------------------------------------------
K=$(budget kernels)
krc=0
if [ "$K" -gt 0 ]; then
  timeout $(( K / 2 )) "$PY" -m loadtest.bench_kernels --json "$OUT/31_kernels.json" >"$OUT/30_kernels.log" 2>&1 || krc=1
  timeout $(( K / 2 )) "$PY" -m loadtest.bench_quant_kernels --json "$OUT/33_quant_kernels.json" \
    >"$OUT/32_quant_kernels.log" 2>&1 || krc=1
  {
    echo
    echo "== 3. kernels (rc $krc, $(elapsed) s of the run)"
    tail -n 8 "$OUT/30_kernels.log"
    tail -n 12 "$OUT/32_quant_kernels.log"
  } >>"$SUMMARY"
fi

echo >>"$SUMMARY"
echo "done in $(elapsed) s" >>"$SUMMARY"
rm -rf "$scratch"
cat "$SUMMARY"
exit $(( trc | erc | krc ))

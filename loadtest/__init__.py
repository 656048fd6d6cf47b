"""Load tests and benchmarks: serving client, peer runner, reports, engine benches."""

import os as _os

# The benchmarks' in-process engines run as `pagoda` does (engine/__init__.py
# `prefer_passive_openmp`: torch's idle OpenMP threads sleep instead of spinning on the work
# pool's cores). Set here, in the package every `python -m loadtest.<bench>` imports before its
# module, so before any of them loads torch; a value set by hand is kept.
# The processes the benchmarks start (loadtest/processes.py) get the environment as it was:
# a peer's OpenMP (llama.cpp's ggml threads) keeps its own default, and `pagoda` sets its own.
SET_OMP_WAIT_POLICY = _os.environ.get("PAGODA_CPU_LOOPS") != "openmp" and "OMP_WAIT_POLICY" not in _os.environ
if SET_OMP_WAIT_POLICY:
    _os.environ["OMP_WAIT_POLICY"] = "passive"

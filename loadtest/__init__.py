"""Load tests and benchmarks: serving client, peer runner, reports, engine benches."""

import os as _os

# The benchmarks' in-process engines run as `pagoda` does (engine/__init__.py
# `prefer_passive_openmp`: torch's idle OpenMP threads sleep instead of spinning on the work
# pool's cores). Set here, in the package every `python -m loadtest.<bench>` imports before its
# module, so before any of them loads torch; a value set by hand is kept.
if _os.environ.get("PAGODA_CPU_LOOPS") != "openmp":
    _os.environ.setdefault("OMP_WAIT_POLICY", "passive")

"""Pagoda engine: everything between a request and a token."""

import os as _os
import sys as _sys


def prefer_passive_openmp() -> None:
    """OMP_WAIT_POLICY=passive for this process unless the user set it: torch's idle OpenMP
    threads then sleep at once instead of spinning on the cores the C++ kernels' work pool
    needs (engine/cpu_threads.py says why; docs/BENCHMARKS.md, "32 streams on the 1B-class
    model", what the spin cost `LLM`). Not with PAGODA_CPU_LOOPS=openmp (the kernels as they
    were before the pool, for A/B benchmarks). libgomp reads the variable when torch loads
    it, so this runs when the package is first imported, before the imports below load
    torch: `pagoda` and `from engine import LLM` alike. A program that imported torch
    first keeps the default (the engine's `cpu_threads` start-up fact then says its idle
    threads spin)."""
    if _os.environ.get("PAGODA_CPU_LOOPS") != "openmp" and "torch" not in _sys.modules:
        _os.environ.setdefault("OMP_WAIT_POLICY", "passive")


prefer_passive_openmp()

from engine.config import EngineConfig  # noqa: E402  (torch loads here, after the policy)
from engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in the model stack; keep `import engine` light for the server's cheap paths.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig"]

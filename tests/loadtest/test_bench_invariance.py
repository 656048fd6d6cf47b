"""`python -m loadtest.bench_invariance` runs the default (batch-invariant) engine, the
`--no-batch-invariant` one and the oneDNN-linears one side by side on the bundled model and
prints the table of both loads with the two ratios."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="the invariant bf16 kernels need AVX512-BF16")
def test_bench_invariance_prints_both_loads():
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_invariance", "--rounds", "1", "--input-len", "16", "--output-len", "4",
         "--streams", "3", "--long-input-len", "0", "--kv-cache-memory", "0.05"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith(("| 1 stream |", "| 3 streams |"))]
    assert len(rows) == 2, out
    assert all(line.count("x |") == 2 and "of 1 |" in line for line in rows), out

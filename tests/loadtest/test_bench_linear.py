"""`python -m loadtest.bench_linear` runs and reports every shape with the oneDNN path available."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_bench_linear_reports_each_shape():
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_linear", "--rows", "1", "--dtypes", "float32", "--stream-mb", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| float32 |")]
    assert len(rows) == 4 and not any("unavailable" in r for r in rows), out
    assert "GEMM 2048^3 float32: torch.mm (MKL)" in out

"""`python -m loadtest.bench_decode_paths` runs the engine's CPU decode paths (the fused call,
with the greedy LM head and with the whole head, and the per-op forward) on the bundled
model and reports them against the bound."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="the fused decode call needs AVX512-BF16")
def test_bench_decode_paths_reports_every_path():
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_decode_paths", "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith(("| fused |", "| fused, whole head |", "| per-op |"))]
    assert len(rows) == 3, out
    assert "| fused | " in rows[0] and "| 1.00x |" in rows[0], out
    # The bundled model's bf16 decode reads (tied head once); the greedy head's int8 copy
    # (49,152 x 576 bytes and 6 bytes a row) in place of the bf16 head's 57 MB.
    assert "weights read per step 269 MB (241 MB with the greedy head)" in out, out


@pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="the fused decode call needs AVX512-BF16")
def test_bench_decode_paths_times_a_step_of_several_rows():
    """`--batch 3`: the same paths on steps of three rows, without the batch-1 read bound."""
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_decode_paths", "--rounds", "1", "--batch", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert "3-row decode step, bfloat16" in out, out
    rows = [line for line in out.splitlines() if line.startswith(("| fused |", "| fused, whole head |", "| per-op |"))]
    assert len(rows) == 3 and "| 1.00x |" in rows[0], out
    assert "read bound" not in out and ", bound " not in out, out

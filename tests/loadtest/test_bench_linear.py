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


def test_bench_linear_times_a_revisions_kernel_beside_this_trees():
    """`--shapes llama-1b --baseline-rev HEAD`: the 1B-class shapes, and the C++ kernel of a git
    revision built beside this tree's, called in turns, with whether the two gave the same
    bits (HEAD's kernels are this tree's in a clean checkout: the cached build is reused)."""
    from kernels import cpu_kernels

    if not cpu_kernels.bf16_gemv_available():
        pytest.skip("the C++ bf16 kernel does not run here")
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_linear", "--shapes", "llama-1b", "--rows", "5", "--dtypes", "bfloat16",
         "--stream-mb", "1", "--baseline-rev", "HEAD"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| bfloat16 |")]
    assert [r[1].strip() for r in rows] == ["qkv [3072x2048]", "o_proj [2048x2048]", "gate_up [11264x2048]",
                                           "down_proj [2048x5632]"], out
    assert all(len(r) == 13 and r[-1].strip() in ("yes", "NO") and float(r[-2].strip()[:-1]) > 0 for r in rows), out
    if subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "kernels/csrc"]).returncode == 0:
        assert all(r[-1].strip() == "yes" for r in rows), out  # the same kernels: the same bits

"""`python -m loadtest.bench_decode_paths` runs the engine's CPU decode paths (the fused call;
with the whole LM head; with the 16-bit weights instead of their 12-bit copies; the per-op
forward) on the bundled model and reports them against the bound."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.huge_pages import huge_pages_wanted
from kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="the fused decode call needs AVX512-BF16")
def test_bench_decode_paths_reports_every_path_and_the_fused_steps_phases():
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_decode_paths", "--rounds", "1", "--phases"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    paths = ("| fused |", "| fused, whole head |", "| fused, 16-bit weights |", "| per-op |")
    rows = [line for line in out.splitlines() if line.startswith(paths)]
    c12 = cpu_kernels.c12_available()  # the 12-bit copies need AVX512-VBMI2 too
    assert len(rows) == (4 if c12 else 3), out
    assert "| fused | " in rows[0] and "| 1.00x |" in rows[0], out
    # The bundled model's bf16 decode reads (tied head once); on the fused path the greedy
    # head's int8 copy (49,152 x 576 bytes and 6 bytes a row) in place of the bf16 head's 57
    # MB, and the layers' 12-bit copies (212 -> 160 MB) in place of their bf16 weights.
    fused = "189 MB on the fused path: greedy head, 12-bit copies" if c12 else "241 MB on the fused path: greedy head"
    assert f"weights read per step 269 MB ({fused})" in out, out
    # --phases: the call's clock (csrc PhaseClock) by phase, in the order a step runs them;
    # the linears' and the head's weight bytes add up to the fused path's 189 MB (241 MB).
    table = out[out.index("The fused step by phase"):]
    phase_rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in table.splitlines()
                  if line.startswith("| ") and not line.startswith("| phase")}
    assert list(phase_rows) == ["setup", "norms", "qkv", "rope_cache", "attention", "o_proj", "gate_up", "silu",
                                "down", "head", "outside the call"], out
    assert all(float(cells[0]) > 0 for name, cells in phase_rows.items() if name != "outside the call"), out
    megabytes = sum(float(cells[2]) for cells in phase_rows.values() if cells[2].strip())
    assert round(megabytes) == (189 if c12 else 241), out
    # Each linear's and the head's GFLOP/s also as a share of the bf16 multiply-add peak
    # measured beside the phases (a positive rate, so a share that is a number).
    peak = float(re.search(r"multiply-add peak measured beside them, (\d+) GFLOP/s", table).group(1))
    assert peak > 0, out
    for name in ("qkv", "o_proj", "gate_up", "down", "head"):
        assert re.fullmatch(r" \d+% ", phase_rows[name][5]), (name, out)


@pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="the fused decode call needs AVX512-BF16")
def test_bench_decode_paths_times_a_step_of_several_rows_and_a_revisions_kernels():
    """`--batch 3`: the same paths on steps of three rows, without the batch-1 read bound;
    `--baseline-rev HEAD`: the fused call also on the C++ kernels of a git revision, built
    beside this tree's (in a clean checkout HEAD's are this tree's: the cached build is
    reused), as its own path in the same alternation; `--pages`: also the weights on 4 KB
    pages, where the engine put them on huge pages."""
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_decode_paths", "--rounds", "1", "--batch", "3", "--baseline-rev", "HEAD",
         "--pages"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    assert "3-row decode step, bfloat16" in out, out
    pages = huge_pages_wanted()
    rows = [line for line in out.splitlines()
            if line.startswith(("| fused |", "| fused, HEAD's kernels |", "| fused, weights on 4 KB pages |",
                                "| fused, whole head |", "| per-op |"))]
    assert len(rows) == 4 + pages and "| 1.00x |" in rows[0], out
    assert rows[1].startswith("| fused, HEAD's kernels |") and float(rows[1].split("|")[2].split()[0]) > 0, out
    if pages:
        assert rows[2].startswith("| fused, weights on 4 KB pages |") and float(rows[2].split("|")[2].split()[0]) > 0, out
    assert "16-bit weights" not in out, out  # three rows read the bf16 weights: no such path
    assert "read bound" not in out and ", bound " not in out, out


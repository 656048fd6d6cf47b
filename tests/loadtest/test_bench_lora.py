"""`python -m loadtest.bench_lora --quick` on the tiny random Llama: the adapters it writes
load, requests spread over them run, and both ratios of issue 39's benchmark are reported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_lora_quick_reports_both_ratios(tiny_model_path, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_lora", "--quick", "--model-path", str(tiny_model_path),
         "--server-args", "--kv-cache-memory 0.05 --max-model-len 256", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| adapters @4 |" in out.stdout and "| adapter @1 |" in out.stdout, out.stdout
    assert "adapters / base output tok/s at 4 streams:" in out.stdout, out.stdout
    assert "batch-1 ITL with an adapter / without:" in out.stdout, out.stdout

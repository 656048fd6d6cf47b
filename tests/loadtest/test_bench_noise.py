"""`python -m loadtest.bench_noise --quick` on the tiny random Llama: Pagoda is measured quiet
and beside a busy neighbour, its figures and ratios are reported, and the neighbour is gone
afterwards. (llama-server is not built here; its spec is tested in test_servers.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _busy_loops() -> set[str]:
    """PIDs of the processes running the neighbour's busy loop."""
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return {line.split(None, 1)[0] for line in ps.splitlines() if "while True: pass" in line}


def test_bench_noise_quick_reports_quiet_and_noisy_figures(tiny_model_path, tmp_path):
    before = _busy_loops()
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_noise", "--quick", "--model-path", str(tiny_model_path),
         "--servers", "pagoda", "--noise", "none", "nice19", "--pagoda-args",
         "--kv-cache-memory 0.05 --max-model-len 256", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| pagoda | none |" in out.stdout and "| pagoda | nice19 |" in out.stdout, out.stdout
    result = json.loads((tmp_path / "results.json").read_text())
    for noise in ("none", "nice19"):
        m = result["bundled"]["rounds"][0]["pagoda"][noise]
        assert m["c1_itl_ms"] > 0 and m["c4_tok_s"] > 0 and not m["capped"], m
        # Every stream ran to its end (not capped); a random model's byte tokens may hold
        # text back, so chunks with text can be fewer than the 4 x 8 tokens.
        assert 0 < m["c4"]["output_tokens"] <= 4 * 8, m
    assert _busy_loops() <= before  # the neighbour was stopped

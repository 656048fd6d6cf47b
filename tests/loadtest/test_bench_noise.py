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
        # The read pace around the c=1 requests, before and after.
        assert len(m["c1_read_gbs"]) == 2 and min(m["c1_read_gbs"]) > 0, m
    assert "read GB/s around c=1" in out.stdout, out.stdout
    assert _busy_loops() <= before  # the neighbour was stopped
    # The c=4 workload's FLOP bound at the GEMM peak measured before and after the servers.
    bound = result["bundled"]["flop_bound"]
    assert len(bound["gemm_gflops"]) == 2 and min(bound["gemm_gflops"]) > 0, bound
    assert bound["tok_s"] > result["bundled"]["rounds"][0]["pagoda"]["none"]["c4_tok_s"], bound
    assert "bundled: c=4 FLOP bound" in out.stdout and "pagoda " in out.stdout.split("FLOP bound")[1], out.stdout


def test_a_request_counts_its_prompt_rows_once_and_the_head_on_its_last_row_only():
    """bench_offline.request_flops, by hand on a model of 100 matmul weights (10 of them the
    head), one layer, one head of dim 1: a 2-token prompt is 2 x 90 x 2 for the layers, 2 x 10
    for the head on its last row and 4 x (1 + 2) for causal attention = 392; its 2 decode steps
    (3 tokens in all) 2 x 100 + 4 x 3 and 2 x 100 + 4 x 4 = 428."""
    from loadtest.bench_offline import ModelSize, request_flops

    size = ModelSize(num_params=100, matmul_params=100, num_layers=1, num_heads=1, head_dim=1, head_params=10)
    assert request_flops(size, 2, 3) == 392 + 428


def test_each_noise_condition_gets_prompts_of_its_own_and_every_server_the_same(default_model_path):
    """A server measured quiet and then beside a neighbour would find the quiet run's prompts
    in its prefix cache and skip their prefill: each condition's prompts differ, and a second
    call (the next server) gives the same ones."""
    from loadtest.bench_noise import NOISE, noise_workloads
    from loadtest.datasets import DatasetSpec, LengthRange, TextSource

    spec = DatasetSpec("random", input_len=LengthRange(32, 32), output_len=LengthRange(64, 64))
    source = TextSource(default_model_path)
    first = noise_workloads(spec, 3, 8, source)
    assert set(first) == set(NOISE)
    prompts = {noise: [r.prompt for r in one + many] for noise, (one, many) in first.items()}
    assert all(len(p) == 3 + 8 for p in prompts.values())
    seen = [prompt for p in prompts.values() for prompt in p]
    assert len(set(map(str, seen))) == len(seen)  # no prompt in two conditions (or twice in one)
    again = noise_workloads(spec, 3, 8, source)
    assert {noise: [r.prompt for r in one + many] for noise, (one, many) in again.items()} == prompts


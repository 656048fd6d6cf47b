"""Smoke test of `python -m loadtest.bench_cpu_attention`: it runs and prints both tables
(the figures themselves are benchmarks, quoted in docs/BENCHMARKS.md, never asserted)."""

from loadtest import bench_cpu_attention


def test_bench_cpu_attention_prints_both_tables(capsys):
    assert bench_cpu_attention.main(["--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 64 x 190 tokens |" in out and "| 150 x 7000 |" in out
    assert "GFLOP/s" in out

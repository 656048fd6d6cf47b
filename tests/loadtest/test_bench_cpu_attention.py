"""Smoke test of `python -m loadtest.bench_cpu_attention --quick`: it runs and prints its tables
(the figures themselves are benchmarks, quoted in docs/BENCHMARKS.md, never asserted)."""

from loadtest import bench_cpu_attention


def test_bench_cpu_attention_prints_its_tables(capsys):
    assert bench_cpu_attention.main(["--repeats", "1", "--quick"]) == 0
    out = capsys.readouterr().out
    for row in ("| 8 x 190 tokens |", "| 8 x 100 tokens |", "| 2 x 64 tokens |", "| 40 x 1200 |"):
        assert row in out
    assert "GFLOP/s" in out
    assert "| 8 x 64 tokens | spread over 512 |" in out and "| huge / 4 KB |" in out


def test_the_baseline_table_times_this_tree_against_a_revision(capsys):
    """`--baseline-rev HEAD`: HEAD's kernels are built beside this tree's (or are this tree's
    when they match) and both decode the same batches: the same bits either way, since no
    change to the kernels may change a row's output."""
    assert bench_cpu_attention.main(["--repeats", "1", "--quick", "--baseline-rev", "HEAD"]) == 0
    out = capsys.readouterr().out
    assert "| this / HEAD | same bits |" in out
    rows = [line for line in out.splitlines() if line.startswith("| 4 x 64 tokens |")]
    assert len(rows) == 2 and "| default (invariant) |" in rows[0], rows  # and the few-row loop
    assert all(row.endswith("| yes |") for row in rows), rows

"""`python -m loadtest` against a real pagoda server: its counts are the server's counts, its
outputs are well-formed, and a killed server ends the run with errors instead of a hang."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadtest.cli import main
from loadtest.server_metrics import parse_metrics

REPO_ROOT = Path(__file__).resolve().parents[2]
LEVELS = (1, 3)
NUM_PROMPTS = 6


@pytest.fixture(scope="module")
def sweep_run(pagoda, default_model_path, tmp_path_factory) -> Path:
    """One short sweep (concurrency 1 and 3, 6 prompts each) with an SLO; its output folder."""
    out = tmp_path_factory.mktemp("loadtest-run")
    rc = main([
        "--base-url", pagoda.url, "--name", "pagoda", "--concurrency", ",".join(map(str, LEVELS)),
        "--num-prompts", str(NUM_PROMPTS), "--input-len", "12:40", "--output-len", "5:12", "--warmup", "2",
        "--tokenizer", str(default_model_path), "--slo", "ttft:60000", "--slo", "tpot:60000",
        "--out", str(out), "--progress", "none",
    ])
    assert rc == 0
    return out


def strict_json(path: Path) -> dict:
    def no_constant(name):
        raise ValueError(f"{path}: non-JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=no_constant)


@pytest.mark.parametrize("level", range(len(LEVELS)), ids=[f"concurrency-{c}" for c in LEVELS])
def test_counts_match_server_usage_and_metrics(sweep_run, level):
    doc = strict_json(sweep_run / "results.json")
    run = doc["servers"][0]["runs"][level]
    s, requests = run["summary"], run["requests"]
    assert (s["requests"], s["completed"], s["failed"]) == (NUM_PROMPTS, NUM_PROMPTS, 0), s["first_errors"]
    # ignore_eos: every request got exactly its max_tokens, as the server's usage says.
    assert s["tokens_from_usage"] is True
    assert [r["output_tokens"] for r in requests] == [r["max_tokens"] for r in requests]
    assert s["output_tokens"] == sum(r["max_tokens"] for r in requests)
    # The server's own counters moved by exactly what the client counted (warm-up excluded).
    deltas = run["server_metrics"]["deltas"]
    assert deltas["generation_tokens_total"] == s["output_tokens"]
    assert deltas["prompt_tokens_total"] == s["prompt_tokens"] == sum(r["prompt_tokens"] for r in requests)
    assert deltas["request_success_total"] == NUM_PROMPTS
    assert deltas["request_success_total:length"] == NUM_PROMPTS
    assert run["server_metrics"]["samples"] >= 1
    assert 0 <= run["server_metrics"]["peaks"]["kv_cache_usage_perc"] <= 1
    # Every latency figure is there and ordered.
    for metric in ("ttft", "tpot", "itl", "e2e"):
        d = s[metric]
        assert 0 <= d["median_ms"] <= d["p90_ms"] <= d["p99_ms"] <= d["max_ms"], (metric, d)
    assert s["goodput"]["good_requests"] == NUM_PROMPTS


def test_json_is_well_formed(sweep_run):
    doc = strict_json(sweep_run / "results.json")
    assert doc["schema"] == "pagoda-loadtest/1"
    assert doc["command"].split()[1:3] == ["-m", "loadtest"]
    assert [run["load"]["concurrency"] for run in doc["servers"][0]["runs"]] == list(LEVELS)
    assert doc["workload"]["levels"][0]["request_rate"] == "inf"  # not Infinity, which JSON lacks
    assert doc["servers"][0]["request_mode"] == "ignore_eos"


def _table_blocks(text: str) -> list[list[str]]:
    blocks, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    return blocks + ([current] if current else [])


def _cells(row: str) -> list[str]:
    return re.split(r"(?<!\\)\|", row.strip())[1:-1]


def test_markdown_is_well_formed(sweep_run):
    text = (sweep_run / "summary.md").read_text()
    doc = strict_json(sweep_run / "results.json")
    assert text.startswith("# ")
    assert f"```\n{doc['command']}\n```" in text
    assert "## Per server" in text
    tables = _table_blocks(text)
    assert len(tables) == 2  # latencies, server-side figures
    for table in tables:
        assert re.fullmatch(r"\|(-{3}:?\|)+", table[1]), table[1]
        widths = {len(_cells(row)) for row in table}
        assert widths == {len(_cells(table[0]))}, table
        assert len(table) == 2 + len(LEVELS)
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (sweep_run / link).is_file(), link


def test_plots_are_png(sweep_run):
    pytest.importorskip("matplotlib")
    doc = strict_json(sweep_run / "results.json")
    assert len(doc["plots"]) == 3
    for plot in doc["plots"]:
        assert Path(plot["path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rate_mode_and_duration_bound(pagoda, tmp_path):
    """Bursty arrivals at 20/s with no concurrency cap, cut by a 1 s duration bound."""
    t0 = time.monotonic()
    rc = main([
        "--base-url", pagoda.url, "--request-rate", "20", "--burstiness", "0.5", "--concurrency", "none",
        "--num-prompts", "200", "--duration", "1", "--input-len", "8", "--output-len", "4", "--warmup", "0",
        "--tokenizer", "words", "--out", str(tmp_path), "--progress", "plain",
    ])
    assert rc == 0
    run = strict_json(tmp_path / "results.json")["servers"][0]["runs"][0]
    s = run["summary"]
    assert 1 <= s["requests"] < 200 and s["failed"] == 0, s
    starts = [r["start_s"] for r in run["requests"]]
    assert starts == sorted(starts) and starts[-1] <= 1.0 + 0.2
    assert time.monotonic() - t0 < 60


def _in_flight(url: str) -> float:
    try:
        m = parse_metrics(httpx.get(f"{url}/metrics", timeout=2).text)
    except httpx.HTTPError:
        return 0.0
    return m.get("num_requests_running", 0) + m.get("num_requests_waiting", 0)


def test_killed_server_shows_up_as_errors_not_a_hang(start_pagoda, tmp_path):
    server = start_pagoda()  # a server of its own: this test kills it
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "loadtest", "--base-url", server.url, "--concurrency", "4",
           "--num-prompts", "24", "--input-len", "16", "--output-len", "64", "--warmup", "0",
           "--tokenizer", "words", "--request-timeout", "30", "--out", str(out), "--progress", "plain"]
    log = open(tmp_path / "loadtest.log", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while _in_flight(server.url) < 2:  # the measured requests are on the server
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "loadtest.log").read_text()
            time.sleep(0.05)
        os.killpg(server.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    output = (tmp_path / "loadtest.log").read_text()
    assert time.monotonic() - killed_at < 30, output
    assert rc == 0, output
    s = strict_json(out / "results.json")["servers"][0]["runs"][0]["summary"]
    assert s["requests"] == 24 and s["failed"] >= 1 and s["completed"] < 24, s
    assert set(s["errors_by_kind"]) <= {"connection_lost", "connect_error", "incomplete_stream"}, s
    assert "errors:" in (out / "summary.md").read_text()

"""The long-prompt scenario's arithmetic (loadtest/bench_long_prompt.py), the vLLM peer's
start-up recipe, and the per-server memory and CPU readings, without starting a server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.bench_long_prompt import stall_summary, token_times
from loadtest.client import RequestResult
from loadtest.machine import _process_seconds, server_seconds, session_memory_mib
from loadtest.servers import PORT, Skipped, vllm_spec


def _stream(start: float, ttft: float, gaps: list[float]) -> RequestResult:
    return RequestResult(ok=True, start_s=start, e2e_s=ttft + sum(gaps), ttft_s=ttft, itl_s=gaps)


def test_token_times_are_absolute():
    assert token_times(_stream(1.0, 0.5, [0.1, 0.2])) == pytest.approx([1.5, 1.6, 1.8])


def test_stall_summary_measures_the_gaps_inside_the_prefill_window():
    # Long prompt sent at t=3 s, first token 2 s later: the window is (3, 5].
    long = RequestResult(ok=True, start_s=3.0, e2e_s=2.1, ttft_s=2.0, prompt_tokens=7500)
    # Stream A: tokens every 0.1 s until 3.0, then a 1.5 s stall, then every 0.1 s.
    a = _stream(0.0, 1.0, [0.1] * 20 + [1.5] + [0.1] * 30)
    # Stream B: steady 0.2 s gaps throughout.
    b = _stream(0.0, 1.0, [0.2] * 40)
    out = stall_summary(3.0, long, [a, b])
    assert out["long_ttft_s"] == 2.0 and out["long_prompt_tokens"] == 7500
    assert out["streams_max_gap_s"] == 1.5
    assert out["streams_median_gap_before_ms"] in (100.0, 200.0)
    assert out["streams_still_decoding_at_first_token"]
    assert 0 < out["streams_tok_s_during_prefill"] < 20


def test_vllm_peer_is_skipped_with_a_reason_until_its_python_is_given(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGODA_VLLM_PYTHON", raising=False)
    skipped = vllm_spec(tmp_path, "bfloat16", None)
    assert isinstance(skipped, Skipped) and "--vllm-python" in skipped.reason
    missing = vllm_spec(tmp_path, "bfloat16", str(tmp_path / "nope" / "python"))
    assert isinstance(missing, Skipped) and "is not a file" in missing.reason


def test_vllm_peer_command_follows_the_recipe(tmp_path):
    """A fake venv whose python imports a `vllm` package: the command and environment the
    README's recipe gives (api_server module, 2 GiB KV, the venv's libiomp5 preloaded)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site.parent} exec {os.path.realpath(os.sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    spec = vllm_spec(Path("/models/m"), None, str(python))
    assert not isinstance(spec, Skipped), spec
    assert spec.command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert spec.command[spec.command.index("--port") + 1] == PORT
    assert spec.command[spec.command.index("--dtype") + 1] == "bfloat16"
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert spec.env["LD_PRELOAD"] == str(venv / "lib" / "libiomp5.so")


def test_session_memory_counts_this_session():
    mib = session_memory_mib(os.getsid(0))
    assert mib is not None and mib > 10  # at least this Python process
    assert session_memory_mib(2**22 + 12345) is None  # no such session


def test_server_cpu_counts_the_workers_in_its_session(tmp_path):
    """A server that leads its session (loadtest/processes.py starts them so) with a worker
    process that is not reaped while the run goes on, as vLLM's engine core: the worker's
    CPU seconds are the server's (loadtest/machine.py OtherCpu), not other work. Before, only
    the leading process counted, and vLLM's runs reported its engine core as 1.7-1.9 cores
    of other work."""
    ready = tmp_path / "burned"
    worker = ("import time, pathlib\n"
              "while time.process_time() < 0.5: pass\n"
              f"pathlib.Path({str(ready)!r}).write_text('x')\n"
              "time.sleep(60)\n")
    leader = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {worker!r}]).wait()"],
        start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and leader.poll() is None, "the worker did not burn its 0.5 s"
            time.sleep(0.05)
        own = _process_seconds(leader.pid)
        whole = server_seconds(leader.pid)
        assert own is not None and whole is not None
        assert whole >= own + 0.45  # the worker's 0.5 s of CPU (clock ticks of 10 ms)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()

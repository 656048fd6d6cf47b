"""How the peers are found and started (without starting them: transformers serve sizes its
KV cache from free RAM, ~10 GB here, too much for a test)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from loadtest.processes import REPO_ROOT
from loadtest.servers import ServerSpec, Skipped, llama_cpp_spec, pagoda_spec, peer_specs


def test_pagoda_command():
    spec = pagoda_spec(None, "float32", ["--max-num-seqs", "8"])
    assert spec.command[:4] == [sys.executable, "-m", "server.cli", "serve"]
    assert "{port}" in spec.command and spec.command[-4:] == ["--dtype", "float32", "--max-num-seqs", "8"]
    assert "--port 1234" in spec.display_command(1234)


def test_transformers_serve_is_started_offline_on_the_model_folder(default_model_path):
    transformers = peer_specs(default_model_path, "float32", None, ["--cb-num-blocks", "64"])[0]
    if isinstance(transformers, Skipped):  # e.g. fastapi or openai missing: the reason says which
        assert transformers.reason
        return
    assert isinstance(transformers, ServerSpec)
    cmd = transformers.command
    assert cmd[cmd.index("serve") + 1] == "--continuous-batching" and cmd[-1] == str(default_model_path)
    assert cmd[-3:-1] == ["--cb-num-blocks", "64"] and "--dtype" in cmd
    assert transformers.env["HF_HUB_OFFLINE"] == "1"
    assert transformers.model == str(default_model_path)  # its /v1/models lists the hub cache, not this


def test_llama_cpp_is_skipped_with_a_reason_when_missing(tmp_path):
    spec = llama_cpp_spec(tmp_path / "missing.gguf")
    if importlib.util.find_spec("llama_cpp") is None:
        assert isinstance(spec, Skipped) and "llama_cpp" in spec.reason
    else:
        assert isinstance(spec, Skipped) and ("GGUF" in spec.reason or "needs" in spec.reason)


def test_llama_server_is_found_by_flag_or_env_and_started_with_its_slots(tmp_path, monkeypatch):
    from loadtest.servers import LLAMA_SERVER_ENV, llama_server_spec

    gguf = tmp_path / "model-bf16.gguf"
    gguf.write_bytes(b"GGUF")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    monkeypatch.delenv(LLAMA_SERVER_ENV, raising=False)
    missing = llama_server_spec(gguf, binary=str(tmp_path / "nowhere"))
    assert isinstance(missing, Skipped) and "no llama-server binary" in missing.reason
    assert isinstance(llama_server_spec(tmp_path / "none.gguf", binary=str(binary)), Skipped)
    monkeypatch.setenv(LLAMA_SERVER_ENV, str(binary))
    spec = llama_server_spec(gguf, threads=2, parallel=32, ctx_per_slot=160)
    assert isinstance(spec, ServerSpec) and spec.command[0] == str(binary) and spec.model == "model-bf16"
    cmd = spec.command
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-tb") + 1] == "2"
    assert cmd[cmd.index("-np") + 1] == "32" and cmd[cmd.index("-c") + 1] == str(32 * 160)
    assert "--cont-batching" in cmd and "{port}" in cmd


def test_started_processes_get_the_environment_without_the_policy_loadtest_set(tmp_path):
    """loadtest/__init__.py sets OMP_WAIT_POLICY=passive for the benchmarks' own engines; a
    process they start (a peer such as llama-server, whose OpenMP threads would then sleep
    at every barrier) gets the environment as it was, and a value set by hand is passed on."""
    probe = ("import loadtest, os, sys; from loadtest.processes import Process; "
             "p = Process('probe', [sys.executable, '-c', 'import os; print(os.environ.get(\"OMP_WAIT_POLICY\"))'], "
             "__import__('pathlib').Path(sys.argv[1])); p.proc.wait(); p.log.close(); "
             "print(os.environ.get('OMP_WAIT_POLICY'), open(sys.argv[1]).read().strip())")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "PAGODA_CPU_LOOPS")}
    for env, want in (({}, "passive None"), ({"OMP_WAIT_POLICY": "active"}, "active active")):
        run = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "log.txt")], capture_output=True, text=True,
                             timeout=60, env=base | env, cwd=REPO_ROOT)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.split("\n")[-2] == want, run.stdout

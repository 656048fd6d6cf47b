"""How the peers are found and started (without starting them: transformers serve sizes its
KV cache from free RAM, ~10 GB here, too much for a test)."""

from __future__ import annotations

import importlib.util
import sys

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

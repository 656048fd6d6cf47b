"""The presets in configs/ load through `pagoda serve --config NAME` and its config classes.

Each preset goes through the CLI's own parsing (`server.cli.parse_serve_args`, which maps
YAML keys onto flags) and then the same config classes `pagoda serve` builds
(`EngineConfig.from_engine_args`, `ServerConfig`), without loading a model.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine.config import EngineConfig
from server.config import ServerConfig
from server.cli import build_parser, engine_args_from, parse_serve_args

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = REPO_ROOT / "configs"
PRESETS = ["cpu-default", "h200-llama3-8b", "h200-llama3-8b-int4", "low-latency", "high-throughput"]


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return parser._subparsers._group_actions[0].choices["serve"]


def load_preset(name: str, *flags: str) -> argparse.Namespace:
    return parse_serve_args(build_parser(), ["serve", "--config", name, *flags])


def build_configs(ns: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """What `server.cli.run_serve` builds from the namespace before it loads the model."""
    server = ServerConfig(
        served_model_name=ns.served_model_name,
        api_key=ns.api_key or None,
        max_body_bytes=ns.max_body_bytes,
        max_n=ns.max_n,
        health_stall_timeout_s=ns.health_stall_timeout,
        tokenizer_threads=ns.tokenizer_threads,
    )
    assert ns.max_waiting_requests >= 1
    return EngineConfig.from_engine_args(model=ns.model, **engine_args_from(ns)), server


def test_every_preset_is_listed():
    on_disk = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert on_disk == sorted(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_documented(name):
    text = (CONFIGS / f"{name}.yaml").read_text()
    assert text.startswith("#"), f"{name}.yaml should open with a comment saying what it is for"
    assert f"--config {name}" in text, f"{name}.yaml should show how it is used"


@pytest.mark.parametrize("name", PRESETS)
def test_preset_values_reach_the_flags(name):
    data = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    ns = load_preset(name)
    serve = serve_parser(build_parser())
    actions = {a.dest: a for a in serve._actions}
    for key, value in data.items():
        dest = key.replace("-", "_")
        assert getattr(ns, dest) == value, (key, getattr(ns, dest), value)
        # argparse checks `choices` only for values typed on the command line, not for defaults
        # (which is what a config file's values become): check them here.
        if actions[dest].choices is not None:
            assert value in actions[dest].choices, (key, value, actions[dest].choices)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_validates_in_the_config_classes(name):
    engine, server = build_configs(load_preset(name))
    data = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    if "max_num_seqs" in data:
        assert engine.scheduler.max_num_seqs == data["max_num_seqs"]
    if "max_num_batched_tokens" in data:
        assert engine.scheduler.max_num_batched_tokens == data["max_num_batched_tokens"]
    if "model" in data:
        assert engine.model.model == data["model"]
    if "served_model_name" in data:
        assert server.served_model_name == data["served_model_name"]


def test_command_line_overrides_the_preset():
    ns = load_preset("low-latency", "--max-num-seqs", "3")
    assert ns.max_num_seqs == 3
    assert ns.max_num_batched_tokens == 512  # still the preset's


def test_unknown_key_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_seqz: 4\n")
    with pytest.raises(ValueError, match="unknown key 'max_num_seqz'"):
        load_preset(str(bad))


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("preset, folder", [
    ("h200-llama3-8b", "/models/Meta-Llama-3-8B-Instruct"),
    ("h200-llama3-8b-int4", "/models/Meta-Llama-3-8B-Instruct-AWQ"),
])
def test_pagoda_serve_h200_preset_gets_as_far_as_the_model_folder(preset, folder):
    # The config is valid; only the model folder is missing on this machine.
    run = _serve("--config", preset, "--port", "1")
    assert run.returncode == 2, run.stderr
    assert folder in run.stderr
    assert "not a Hugging Face model folder" in run.stderr

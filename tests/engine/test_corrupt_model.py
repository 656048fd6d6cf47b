"""A damaged model folder fails the start in one line that names the file and what is wrong
(`pagoda serve` prints it and exits 2), never a traceback from deep inside a load."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.loader import load_hf_config, load_model, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]


def _truncate_weights(folder: Path) -> Path:
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return file


def _zero_heads(folder: Path) -> Path:
    file = folder / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "num_attention_heads": 0}))
    return file


def _break_config(folder: Path) -> Path:
    file = folder / "config.json"
    file.write_text('{"model_type": "llama", ')
    return file


def _break_tokenizer(folder: Path) -> Path:
    file = folder / "tokenizer.json"
    file.write_text('{"version": "1.0", "model": ')
    return file


def _load_weights(folder: Path) -> None:
    load_model(folder, torch.float32, torch.device("cpu"), 64)


CASES = [
    # (damage, the load that meets it, words the message must have)
    (_truncate_weights, _load_weights, "not a valid safetensors file"),
    (_zero_heads, load_hf_config, "num_attention_heads must be a positive integer, got 0"),
    (_break_config, load_hf_config, "invalid JSON"),
    (_break_tokenizer, load_tokenizer, "cannot load the tokenizer"),
]


@pytest.fixture
def damaged(tiny_model_path, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    return folder


@pytest.mark.parametrize("damage,load,words", CASES, ids=[c[0].__name__.strip("_") for c in CASES])
def test_the_error_names_the_file_and_the_fault(damaged, damage, load, words):
    file = damage(damaged)
    with pytest.raises(ValueError) as e:
        load(damaged)
    message = str(e.value)
    assert message.startswith(f"{file}: ") and words in message and "\n" not in message, message


def test_pagoda_serve_prints_one_line_and_exits_2(damaged):
    file = _zero_heads(damaged)
    run = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(damaged), "--port", "1",
         "--kv-cache-memory", "0.05"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2, run.stderr
    assert len(lines) == 1 and lines[0].startswith(f"pagoda: error: {file}: "), run.stderr

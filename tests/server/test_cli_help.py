"""`pagoda serve --help`: every flag says what it does, its default and (where it has them)
its choices, from the same config classes as the README table (server/config_doc.py)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import DTYPES, KERNEL_BACKENDS, LOAD_FORMATS, QUANTIZATION_METHODS
from server import config_doc
from server.cli import build_parser
from server.tools.parsers import TOOL_PARSERS

REPO_ROOT = Path(__file__).resolve().parents[2]


def serve_flags() -> list[argparse.Action]:
    return [a for a in config_doc.serve_parser()._actions if a.option_strings and a.dest != "help"]


def flag_name(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


@pytest.fixture(scope="module")
def help_text() -> str:
    """`pagoda serve --help` as a user runs it (the console script where installed)."""
    script = Path(sys.executable).with_name("pagoda")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "server.cli"]
    run = subprocess.run(
        [*command, "serve", "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "100"},
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def help_entries(text: str) -> dict[str, str]:
    """Flag -> its whole `--help` entry (invocation and help text, whitespace collapsed)."""
    options = text[text.index("options:"):]
    entries: dict[str, str] = {}
    current = None
    for line in options.splitlines()[1:]:
        match = re.match(r"^  (-{1,2}[\w-]+)", line)
        if match:
            current = match.group(1)
            entries[current] = line.strip()
        elif current is not None and line.startswith("   "):
            entries[current] += " " + line.strip()
    return {flag: " ".join(entry.split()) for flag, entry in entries.items()}


def test_every_serve_flag_has_help_and_a_default():
    undocumented = [flag_name(a) for a in serve_flags() if not (a.help or "").strip()]
    assert not undocumented, f"flags without help text: {undocumented}"
    without_default = [flag_name(a) for a in serve_flags() if not getattr(a, "default_text", None)]
    assert not without_default, f"flags without a shown default: {without_default}"


def test_help_output_shows_text_and_default_for_every_flag(help_text):
    entries = help_entries(help_text)
    for action in serve_flags():
        # argparse lists the first option string first (`--tensor-parallel-size ..., -tp`).
        entry = entries.get(action.option_strings[0])
        assert entry is not None, f"{action.option_strings[0]} is missing from `pagoda serve --help`"
        assert re.search(r"\(default: [^)]+\)$", entry), f"no default on {action.option_strings[0]}'s line: {entry!r}"
        help_part = re.sub(r"\(default: [^)]+\)$", "", entry)
        # The words of the help, beyond the flag and its metavar.
        words = [w for w in help_part.split() if not w.startswith("-") and not w.isupper() and not w.startswith("{")]
        assert len(words) >= 3, f"{action.option_strings[0]} has no help text: {entry!r}"


def test_help_is_the_config_field_docstring(help_text):
    """One source: a flag with a config field shows that field's docstring."""
    entries = help_entries(help_text)
    fields = config_doc.config_fields()
    for flag, name in [("--max-model-len", "max_model_len"), ("--quantization", "quantization"),
                       ("--dtype", "dtype"), ("--seed", "seed"), ("--max-n", "max_n"),
                       ("--health-stall-timeout", "health_stall_timeout_s")]:
        assert fields[name].doc in entries[flag], (flag, entries[flag])


@pytest.mark.parametrize("flag, default", [
    ("--max-model-len", "none"), ("--max-num-seqs", "128"), ("--max-num-batched-tokens", "2048"),
    ("--seed", "0"), ("--kernel-backend", "auto"), ("--dtype", "auto"), ("--quantization", "none"),
    ("--port", "8000"), ("--api-key", "$PAGODA_API_KEY, else none"), ("--enforce-eager", "not set"),
])
def test_help_shows_the_effective_default(help_text, flag, default):
    # A flag left unset takes the config field's default, and --help says which.
    assert f"(default: {default})" in help_entries(help_text)[flag]


@pytest.mark.parametrize("flag, choices", [
    ("--dtype", DTYPES),
    ("--quantization", QUANTIZATION_METHODS),
    ("--kernel-backend", KERNEL_BACKENDS),
    ("--load-format", LOAD_FORMATS),
    ("--tool-call-parser", tuple(TOOL_PARSERS)),
    ("--reasoning-parser", ("auto", "none", "qwen3", "deepseek_r1")),
    ("--log-level", ("critical", "error", "warning", "info", "debug")),
])
def test_flag_has_choices(flag, choices):
    action = next(a for a in serve_flags() if flag in a.option_strings)
    assert action.choices is not None and set(choices) <= set(action.choices), (flag, action.choices)


@pytest.mark.parametrize("flag, shown", [
    ("--dtype", "{auto,float32,float16,bfloat16}"),
    ("--quantization", "{int8,int4,w8a8}"),
    ("--kernel-backend", "{auto,cpu,torch,triton}"),
    ("--load-format", "{auto,dummy,dequantize}"),
    ("--tool-call-parser", "{hermes,llama3_json}"),
])
def test_help_shows_the_choices(help_text, flag, shown):
    assert help_entries(help_text)[flag].startswith(f"{flag} {shown}")


def test_dtype_aliases_still_parse():
    for alias in ("fp32", "half", "bf16"):
        ns = build_parser().parse_args(["serve", "--dtype", alias])
        assert ns.dtype == alias


def test_invalid_choice_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--quantization", "int3"])
    assert exc.value.code == 2
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_a_flag_without_documentation_is_refused():
    parser = argparse.ArgumentParser()
    parser.add_argument("--made-up-flag", type=int, default=1)
    with pytest.raises(ValueError, match="--made-up-flag"):
        config_doc.document_flags(parser)


def test_percent_in_a_doc_survives_argparse():
    parser = argparse.ArgumentParser(formatter_class=config_doc.FlagHelpFormatter)
    parser.add_argument("--share", type=float, default=0.5, help="share of the GPU, 50% by default")
    config_doc.document_flags(parser)
    assert "50% by default (default: 0.5)" in " ".join(parser.format_help().split())


def test_generate_and_quantize_help_render():
    parser = build_parser()
    subparsers = parser._subparsers._group_actions[0].choices
    for name in ("serve", "generate", "quantize"):
        text = subparsers[name].format_help()
        assert "options:" in text
    assert "(default: 64)" in " ".join(subparsers["generate"].format_help().split())

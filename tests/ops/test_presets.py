"""configs/cpu-default.yaml is what `make serve` runs: the preset equals the defaults.

`make serve` is `pagoda serve $(ARGS)` with no flags of its own, so the preset must set
every key to the default of the config field behind it (`EngineConfig`'s sections,
`ServerConfig`, or the flag's own default) and leave the rest unset.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import yaml

from engine.config import EngineConfig
from server.cli import build_parser, engine_args_from, parse_serve_args
from server.config import ServerConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESET = REPO_ROOT / "configs" / "cpu-default.yaml"


def parse(*argv: str) -> argparse.Namespace:
    return parse_serve_args(build_parser(), ["serve", *argv])


def engine_config(ns: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_engine_args(model=ns.model, **engine_args_from(ns))


def field_defaults() -> dict[str, object]:
    """Every config field's default by name: the engine sections', then the server's."""
    defaults: dict[str, object] = {}
    engine = EngineConfig()
    for section in dataclasses.fields(engine):
        for field in dataclasses.fields(getattr(engine, section.name)):
            defaults[field.name] = getattr(getattr(engine, section.name), field.name)
    server = ServerConfig()
    for field in dataclasses.fields(server):
        defaults[field.name] = getattr(server, field.name)
    return defaults


def test_make_serve_passes_no_flags_of_its_own():
    # The claim "what `make serve` runs" holds only while the target adds nothing to $(ARGS).
    makefile = (REPO_ROOT / "Makefile").read_text()
    recipe = re.search(r"^serve:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, "Makefile has no `serve:` target"
    assert recipe.group(1).strip().endswith("pagoda serve $(ARGS)"), recipe.group(1)


def test_the_preset_says_it_is_what_make_serve_runs():
    assert "exactly what\n# `make serve` runs" in PRESET.read_text()


def test_every_preset_value_is_the_config_default():
    data = yaml.safe_load(PRESET.read_text())
    defaults = field_defaults()
    serve = {a.dest: a for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    for key, value in data.items():
        dest = key.replace("-", "_")
        if dest in defaults:
            assert value == defaults[dest], f"cpu-default sets {key}: {value!r}; the default is {defaults[dest]!r}"
        else:
            assert value == serve[dest].default, f"cpu-default sets {key}: {value!r}; the default is {serve[dest].default!r}"


def test_the_preset_builds_the_default_engine_config():
    preset, default = parse("--config", "cpu-default"), parse()
    assert engine_config(preset) == engine_config(default) == EngineConfig()


def test_the_preset_changes_no_flag():
    # Flag by flag, a value the preset spells out is what the unset flag resolves to.
    preset, default = vars(parse("--config", "cpu-default")), vars(parse())
    defaults = field_defaults()
    for dest in default.keys() - {"config"}:
        resolved = defaults.get(dest) if default[dest] is None else default[dest]
        assert preset[dest] in (default[dest], resolved), (dest, preset[dest], default[dest])


def test_the_preset_spells_out_the_engine_settings():
    # "Spelled out": the settings an operator tunes first are in the file, with their value.
    data = yaml.safe_load(PRESET.read_text())
    for key in ("dtype", "kernel_backend", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        assert key in data, key
    text = PRESET.read_text()
    for unset in ("max_model_len", "kv_cache_memory"):  # default None: resolved at load time
        assert f"# {unset}: unset" in text, unset

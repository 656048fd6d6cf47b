"""Engine settings given as JSON objects (`--speculative-config`, `--kv-events-config`): one
parser, so every such flag refuses bad JSON, a non-object and unknown keys the same way. No
engine imports: engine/config.py and engine/kv_events.py both use it."""

from __future__ import annotations

import json
from collections.abc import Collection


def json_object_setting(raw: str | dict | None, name: str, keys: Collection[str]) -> dict | None:
    """A setting given as a JSON object (a flag's JSON text, or a dict from the Python API or
    a config file): the dict, None when absent. Raises ValueError naming `name` for text that
    is not JSON, a value that is not an object, or keys outside `keys`."""
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{name} must be a JSON object")
    unknown = sorted(set(raw) - set(keys))
    if unknown:
        raise ValueError(f"{name}: unsupported key(s) {unknown}; supported: {sorted(keys)}")
    return raw

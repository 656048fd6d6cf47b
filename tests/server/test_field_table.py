"""Nothing accepted and ignored: every row of docs/REQUEST_FIELDS.md against the real server.

The table is the one place the expectations live: each row's field, endpoint, status and
the value to try. A `400` row must get a 400 naming the field; an `implemented` or `no-op`
row a 200, for a field its request model declares (an undeclared field is read by nobody);
an `ignored` row is a known defect, an expected failure until the field is handled. The
effects of the implemented fields are tested beside each feature.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from server.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat, StreamOptions, known_fields

TABLE = Path(__file__).resolve().parents[2] / "docs" / "REQUEST_FIELDS.md"
BEGIN, END = "<!-- request-fields:begin -->", "<!-- request-fields:end -->"
ENDPOINTS = {"completions": ("/v1/completions", CompletionRequest, {"prompt": "Hello"}),
             "chat": ("/v1/chat/completions", ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}]})}
STATUSES = ("implemented", "no-op", "400", "ignored")
NESTED_MODELS = {"stream_options": StreamOptions, "response_format": ResponseFormat}


def _cell_json(cell: str):
    cell = cell.strip()
    return json.loads(cell.strip("`").replace("\\|", "|")) if cell else {}


def read_table() -> list[tuple[str, str, str, object, dict]]:
    """(field, endpoint, status, value, with) per endpoint of each row."""
    text = TABLE.read_text()
    lines = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip().splitlines()[2:]
    rows = []
    for line in lines:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        field, endpoint, _, status, value, with_ = cells[:6]
        assert status in STATUSES, line
        for name in ENDPOINTS if endpoint == "both" else [endpoint]:
            rows.append((field.strip("`"), name, status, _cell_json(value), _cell_json(with_)))
    return rows


ROWS = read_table()


def declared(endpoint: str, field: str) -> bool:
    """The request model reads the field (a nested one: its object's model): a field of it,
    or one it refuses except at a default value (which then passes, read and checked)."""
    *parents, name = field.split(".")
    model = NESTED_MODELS[parents[0]] if parents else ENDPOINTS[endpoint][1]
    return name in known_fields(model)


def body_for(model_name: str, endpoint: str, field: str, value, with_: dict) -> dict:
    body = {"model": model_name, **ENDPOINTS[endpoint][2], "max_tokens": 2, **with_}
    *parents, name = field.split(".")
    target = body
    for parent in parents:
        target = target[parent]
    target[name] = value
    return body


def test_every_field_the_request_models_know_has_a_row():
    listed = {(field, endpoint) for field, endpoint, *_ in ROWS}
    for endpoint, (_, model, _) in ENDPOINTS.items():
        missing = sorted(name for name in known_fields(model) if name != "model" and (name, endpoint) not in listed)
        assert not missing, f"{endpoint}: no row in {TABLE.name} for {missing}"


@pytest.mark.parametrize(
    "field, endpoint, status, value, with_",
    [pytest.param(*row, id=f"{row[1]}-{row[0]}",
                  marks=[pytest.mark.xfail(strict=True, reason="accepted and ignored: a defect")]
                  if row[2] == "ignored" else []) for row in ROWS])
def test_field_is_implemented_a_noop_or_refused(server_url, model_name, helpers, field, endpoint, status, value, with_):
    path = ENDPOINTS[endpoint][0]
    r = httpx.post(f"{server_url}{path}", json=body_for(model_name, endpoint, field, value, with_), timeout=120)
    if status == "400":
        assert r.status_code == 400, r.text[:300]
        param = helpers.assert_error_envelope(r.json())["param"] or ""
        assert param == field or param.startswith(field + "."), r.text[:300]
        return
    if status == "ignored":  # fails today; passes once the field is handled either way
        if r.status_code == 400:
            assert helpers.assert_error_envelope(r.json())["param"] == field
            return
    assert r.status_code == 200, r.text[:300]
    assert declared(endpoint, field), f"{field} is accepted but no request model reads it"

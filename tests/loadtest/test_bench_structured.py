"""`python -m loadtest.bench_structured --quick` on the tiny model: it prints its table,
both arms generate exactly output-len tokens per row, and every constrained output is a
JSON prefix of a document the bench's schema allows. No timing is asserted."""

from __future__ import annotations

import json

import jsonschema
import pytest

from loadtest.bench_structured import ITEM_MAX_LENGTH, bench_schema, complete_json_prefix, json_prefix_ok, main


@pytest.mark.parametrize("prefix", [
    "", "{", '{"', '{"ti', '{"title"', '{"title": ', '{"title": "A \\', '{"title": "A \\u00',
    '{"title": "A", "tags": [', '{"title": "A", "tags": ["x", ', '{"title": "A", "tags": ["x", "y"',
    '{"a": [1, 2.', '{"a": tr', '{"a": {"b": null}, "c": [[], {}',
])
def test_json_prefix_completion(prefix):
    json_prefix_ok(prefix)  # does not raise


@pytest.mark.parametrize("text", ['{"a" "b"', '{"a": 1]', "]", '{"a": 1}}', '{"a": x'])
def test_json_prefix_rejects_non_prefixes(text):
    with pytest.raises(ValueError):
        json_prefix_ok(text)


def test_completion_of_a_partial_escape():
    assert json.loads(complete_json_prefix('["a\\u00')) == ["a"]


def _relaxed(schema: dict) -> dict:
    """The bench schema minus what a prefix cannot meet yet (required keys, minItems)."""
    schema = json.loads(json.dumps(schema))
    schema.pop("required")
    schema["properties"]["tags"].pop("minItems")
    schema["properties"]["tags"]["items"].pop("minLength")  # the last item may be just opened
    schema["properties"]["title"].pop("minLength")
    return schema


def test_quick_run_prints_the_table_and_checks_its_outputs(tiny_model_path, tmp_path, capsys):
    raw_path = tmp_path / "raw.json"
    rc = main(["--quick", "--model", str(tiny_model_path), "--json", str(raw_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for row in [
        "| batch 4 unconstrained (ignore_eos)",
        "| batch 4 JSON schema on every row",
        "| batch 4 constrained / unconstrained tok/s",
        "| batch 1 added time per output token",
        "| grammar compile p50",
        "| grammar compile p99",
        "| batch 4 rows per step that needed a mask",
        "| batch 1 rows per step that needed a mask",
        "| rows | allows | bitmask | apply_grammar_bitmask | accept_token | _constrain, no row masked",
        "| rows | unconstrained step | constrained step | added | masked rows per step |",
        "python -m loadtest.bench_structured --quick --model",
        "all checks passed",
    ]:
        assert row in out, (row, out)
    lines = out.splitlines()
    for rows in ("4", "1"):  # a row in each where-the-time-goes table
        assert sum(line.startswith(f"| {rows} |") for line in lines) == 2, out

    raw = json.loads(raw_path.read_text())
    n = raw["config"]["output_len"]
    assert raw["failures"] == []
    assert set(raw["runs"]) == {"4", "1"}
    relaxed = _relaxed(bench_schema(n))
    for batch, pairs in raw["runs"].items():
        assert pairs
        for pair in pairs:
            for arm in ("unconstrained", "constrained"):
                assert pair[arm]["token_counts"] == [n] * int(batch), (batch, arm, pair[arm])
            assert set(pair["constrained"]["finish_reasons"]) == {"length"}
            for text in pair["constrained"]["texts"]:
                assert text.startswith("{"), text
                doc = json_prefix_ok(text)
                jsonschema.validate(doc, relaxed)
                assert all(len(t) <= ITEM_MAX_LENGTH for t in doc.get("tags", []))
    # 17 specs compiled, every time.
    assert len(raw["compile_ms"]) >= 14 and all(len(v) == 1 for v in raw["compile_ms"].values())
    # The engine's grammar calls were timed, and the sampler masked only some rows.
    for batch in ("4", "1"):
        split = raw["in_engine_split"][batch]
        assert split is not None and 0 <= split["masked_frac"] <= 1, split
        assert raw["alone"][batch]["bad"] == 0
    timers = raw["runs"]["4"][0]["constrained"]["timers"]
    assert timers["rows"] >= 4 * (n - 1) and timers["masked"] < timers["rows"], timers

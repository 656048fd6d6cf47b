"""README's configuration and metrics tables are exactly what the code generates.

Fix a failure with `python -m server.config_doc --write` (after checking the new text).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from server import config_doc
from server.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"
FIX = "README.md is out of date with the code: run `python -m server.config_doc --write`"


def section(text: str, begin: str, end: str) -> str:
    return text[text.index(begin) + len(begin): text.index(end)].strip()


def test_readme_config_table_is_generated():
    text = README.read_text()
    assert section(text, config_doc.CONFIG_BEGIN, config_doc.CONFIG_END) == config_doc.config_table(), FIX


def test_readme_metrics_table_is_generated():
    text = README.read_text()
    assert section(text, config_doc.METRICS_BEGIN, config_doc.METRICS_END) == config_doc.metrics_table(), FIX


def test_every_serve_flag_is_in_the_table():
    serve = config_doc.serve_parser()
    table = config_doc.config_table()
    for action in serve._actions:
        if action.option_strings and action.dest != "help":
            assert f"`{max(action.option_strings, key=len)}" in table, action.option_strings


def test_every_engine_field_is_documented_somewhere():
    from engine.config import EngineConfig

    table = config_doc.config_table()
    for section_field in dataclasses.fields(EngineConfig):
        for name, field in config_doc.field_docs(section_field.default_factory).items():
            assert field.doc, f"{field.owner}.{name} has no docstring"
            assert field.doc in table or f"`{name}" in table, name


def test_cli_defaults_agree_with_the_config_classes():
    """A flag's own default must be unset (None) or the config field's, or the table would lie."""
    fields = config_doc.config_fields()
    for action in config_doc.serve_parser()._actions:
        name = config_doc._FIELD_OF_FLAG.get(action.dest, action.dest)
        if name not in fields or action.dest == "api_key" or action.nargs == 0:
            continue
        assert action.default is None or action.default == fields[name].default, (
            action.dest, action.default, fields[name].default)


# The metrics contract of docs/ARCHITECTURE.md as scraped: counters with `_total`, histograms by `_bucket`.
CONTRACT = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_tail_waste_tokens",
    "prompt_tokens_total", "generation_tokens_total", "request_success_total", "num_preemptions_total",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "http_requests_client_disconnected_total",
    "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
    "request_prompt_tokens_bucket", "request_generation_tokens_bucket", "iteration_tokens_total_bucket",
]


@pytest.mark.parametrize("name", CONTRACT)
def test_contract_metric_is_listed(name):
    assert f"`pagoda:{name}`" in config_doc.metrics_table()


def test_field_docs_reads_the_docstring_after_each_field():
    @dataclasses.dataclass
    class Example:
        alpha: int = 3
        """The first."""
        beta: str | None = None
        gamma: list = dataclasses.field(default_factory=lambda: [1])
        """The   third,
        on two lines."""

    docs = config_doc.field_docs(Example)
    assert (docs["alpha"].default, docs["alpha"].doc) == (3, "The first.")
    assert docs["beta"].doc == ""
    assert (docs["gamma"].default, docs["gamma"].doc) == ([1], "The third, on two lines.")


def test_render_readme_replaces_only_between_the_markers():
    text = f"before\n{config_doc.CONFIG_BEGIN}\nstale\n{config_doc.CONFIG_END}\nmiddle\n" \
           f"{config_doc.METRICS_BEGIN}\n{config_doc.METRICS_END}\nafter\n"
    out = config_doc.render_readme(text)
    assert out.startswith("before\n") and out.endswith("after\n") and "\nmiddle\n" in out
    assert "stale" not in out
    assert config_doc.render_readme(out) == out


def test_build_parser_is_the_one_documented():
    # The generator reads the real `pagoda serve` parser, not a copy.
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert [a.dest for a in serve._actions] == [a.dest for a in config_doc.serve_parser()._actions]

"""configs/grafana-dashboard.json asks only for series the server exposes, the right way.

The names come from a rendered `server.metrics.Metrics` (what `GET /metrics` serves), so a
renamed metric breaks this test rather than silently emptying a panel. Whether Prometheus
accepts every expression is checked against a real Prometheus in test_prometheus.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana-dashboard.json"
METRIC_NAME = re.compile(r"pagoda:[a-zA-Z0-9_:]+")


def exposed_samples() -> dict[str, str]:
    """Sample name (as scraped: `_total`, `_bucket`, ...) -> its family's type."""
    body, _ = Metrics("model").render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[sample.name] = family.type
    return out


SAMPLES = exposed_samples()
DASH = json.loads(DASHBOARD.read_text())
PANELS = DASH["panels"]
EXPRS = [(p["title"], t["expr"]) for p in PANELS for t in p["targets"]]


def panel_exprs(title: str) -> list[str]:
    (panel,) = [p for p in PANELS if p["title"] == title]
    return [t["expr"] for t in panel["targets"]]


def test_the_exposition_is_what_the_dashboard_expects():
    # Sanity of the reference itself: counters gain `_total`, histograms `_bucket`.
    assert SAMPLES["pagoda:generation_tokens_total"] == "counter"
    assert SAMPLES["pagoda:time_to_first_token_seconds_bucket"] == "histogram"
    assert SAMPLES["pagoda:num_requests_running"] == "gauge"


def test_panels_are_well_formed():
    ids = [p["id"] for p in PANELS]
    assert len(ids) == len(set(ids)), ids
    for p in PANELS:
        assert p["targets"], p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"}, p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
    variables = {v["name"]: v for v in DASH["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert "pagoda:" in variables["model_name"]["definition"]


@pytest.mark.parametrize("title,expr", EXPRS, ids=[f"{t}:{i}" for i, (t, _) in enumerate(EXPRS)])
def test_expression_uses_only_exposed_series(title, expr):
    names = METRIC_NAME.findall(expr)
    assert names, f"{title}: no pagoda: series in {expr!r}"
    for name in names:
        assert name in SAMPLES, f"{title}: {name} is not exposed by /metrics"
        kind = SAMPLES[name]
        if kind == "counter":
            assert f"rate({name}" in expr or f"increase({name}" in expr, f"{title}: counter {name} needs rate()"
        if name.endswith("_bucket"):
            assert "histogram_quantile(" in expr and f"rate({name}" in expr, f"{title}: {name}"
        assert '{model_name=~"$model_name"}' in expr, f"{title}: {expr} ignores the model selector"


REQUIRED = {
    "Requests running / waiting": ["pagoda:num_requests_running", "pagoda:num_requests_waiting"],
    "Time to first token": ["pagoda:time_to_first_token_seconds_bucket"],
    "Inter-token latency": ["pagoda:inter_token_latency_seconds_bucket"],
    "Generation throughput": ["pagoda:generation_tokens_total"],
    "KV-cache usage": ["pagoda:kv_cache_usage_perc"],
    "KV-cache tail waste": ["pagoda:kv_cache_tail_waste_tokens"],
    "Prefix-cache hit rate": ["pagoda:prefix_cache_hits_total", "pagoda:prefix_cache_queries_total"],
    "Preemptions": ["pagoda:num_preemptions_total"],
}


@pytest.mark.parametrize("title", sorted(REQUIRED))
def test_required_panel_shows_its_series(title):
    exprs = " ".join(panel_exprs(title))
    for name in REQUIRED[title]:
        assert name in exprs, (title, name)


@pytest.mark.parametrize("title", ["Time to first token", "Inter-token latency"])
def test_latency_panels_show_p50_p90_p99(title):
    quantiles = sorted(float(q) for e in panel_exprs(title) for q in re.findall(r"histogram_quantile\(([0-9.]+),", e))
    assert quantiles == [0.5, 0.9, 0.99]


def test_generation_tokens_per_second_is_a_rate():
    (expr, *_) = panel_exprs("Generation throughput")
    assert "rate(pagoda:generation_tokens_total" in expr

"""A real Prometheus scrapes a real `pagoda serve`, and sees the series move with traffic.

Prometheus is Debian's `prometheus` package (.ci/run installs it where apt-get works); the
scrape config is configs/prometheus.yml with the target moved to the test's server and the
interval cut to 1 s. Everything listens on 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from processes import PORT, REPO_ROOT, TEST_KV_CACHE_GIB, Server, pagoda_command

PROMETHEUS_YML = REPO_ROOT / "configs" / "prometheus.yml"
DASHBOARD = REPO_ROOT / "configs" / "grafana-dashboard.json"
PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None)
PROMTOOL = shutil.which("promtool")
NOT_INSTALLED = (
    "the Prometheus server is not installed (Debian package `prometheus`: apt-get install prometheus;"
    " .ci/run installs it when apt-get works)"
)
PAGODA_STARTUP_S = 180.0
SCRAPE_WAIT_S = 30.0


# ---- the configuration under test -------------------------------------------------------------------


def pagoda_job(config: dict) -> dict:
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "pagoda"]
    return job


def test_prometheus_yml_scrapes_pagoda_every_5s():
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    job = pagoda_job(config)
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"] == [{"targets": ["localhost:8000"]}]


@pytest.mark.skipif(PROMTOOL is None, reason=NOT_INSTALLED)
def test_promtool_accepts_prometheus_yml():
    run = subprocess.run([PROMTOOL, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


# ---- a real Prometheus against a real server ----------------------------------------------------


@pytest.fixture(scope="module")
def pagoda(default_model_path, tmp_path_factory):
    """`pagoda serve --config cpu-default` on a free loopback port (the preset, end to end), with
    a small KV cache (tests/processes.py: TEST_KV_CACHE_GIB says why)."""
    server = Server("pagoda", pagoda_command("--config", "cpu-default", "--max-model-len", "512", "--no-access-log",
                                             "--kv-cache-memory", str(TEST_KV_CACHE_GIB)),
                    tmp_path_factory.mktemp("pagoda"))
    try:
        server.wait_ready(PAGODA_STARTUP_S)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prometheus(pagoda, tmp_path_factory):
    work = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    pagoda_job(config)["static_configs"] = [{"targets": [f"127.0.0.1:{pagoda.port}"]}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = Server(
        "prometheus", [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{PORT}", "--log.level=warn"],
        work, ready_paths=("/-/ready",),
    )
    try:
        server.wait_ready(60)
        yield server
    finally:
        server.stop()


def query(prom, expr: str) -> list[dict]:
    r = httpx.get(f"{prom.url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {r.status_code} {body}"
    return body["data"]["result"]


def scalar(prom, expr: str) -> float | None:
    result = query(prom, expr)
    return float(result[0]["value"][1]) if result else None


def wait_for(prom, expr: str, predicate, what: str, timeout_s: float = SCRAPE_WAIT_S) -> float:
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = scalar(prom, expr)
        if value is not None and predicate(value):
            return value
        time.sleep(0.5)
    targets = httpx.get(f"{prom.url}/api/v1/targets", timeout=10).json()
    pytest.fail(f"{what}: `{expr}` = {value} after {timeout_s:.0f} s; targets: {json.dumps(targets)[:2000]}"
                f"\nprometheus log:\n{prom.tail()}", pytrace=False)


def pagoda_value(pagoda, name: str) -> float:
    """A series' value (summed over labels) straight from the server's /metrics."""
    body = httpx.get(f"{pagoda.url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def complete(pagoda, max_tokens: int) -> dict:
    r = httpx.post(
        f"{pagoda.url}/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


KEY_SERIES = [
    "pagoda:num_requests_running",
    "pagoda:num_requests_waiting",
    "pagoda:kv_cache_usage_perc",
    "pagoda:kv_cache_tail_waste_tokens",
    "pagoda:generation_tokens_total",
    "pagoda:prompt_tokens_total",
    "pagoda:request_success_total",
    "pagoda:num_preemptions_total",
    "pagoda:prefix_cache_queries_total",
    "pagoda:time_to_first_token_seconds_bucket",
    "pagoda:inter_token_latency_seconds_bucket",
]


@pytest.mark.skipif(PROMETHEUS is None, reason=NOT_INSTALLED)
def test_prometheus_scrapes_pagoda_and_sees_traffic(pagoda, prometheus):
    wait_for(prometheus, 'up{job="pagoda"}', lambda v: v == 1, "the pagoda target is up")
    for name in KEY_SERIES:
        wait_for(prometheus, f"count({name})", lambda v: v >= 1, f"{name} is scraped")
    idle_running = scalar(prometheus, "sum(pagoda:num_requests_running)")
    assert idle_running == 0
    generated_before = wait_for(prometheus, "sum(pagoda:generation_tokens_total)", lambda v: v >= 0, "baseline")
    ttft_count_before = scalar(prometheus, "sum(pagoda:time_to_first_token_seconds_count)")

    # One long request keeps the batch busy for a few scrapes: the gauges must show it.
    long_result: dict = {}
    long_request = threading.Thread(target=lambda: long_result.update(complete(pagoda, 400)), daemon=True)
    long_request.start()
    try:
        wait_for(prometheus, "sum(pagoda:num_requests_running)", lambda v: v >= 1, "a running request is seen")
        wait_for(prometheus, "max(pagoda:kv_cache_usage_perc)", lambda v: v > 0, "KV usage while running")
        short = [complete(pagoda, 16) for _ in range(4)]
    finally:
        long_request.join(timeout=180)
    assert not long_request.is_alive(), "the long request did not finish within 180 s"
    generated = sum(c["usage"]["completion_tokens"] for c in short) + long_result["usage"]["completion_tokens"]
    assert generated == 4 * 16 + 400

    # Prometheus converges on exactly what the server itself reports.
    expected = pagoda_value(pagoda, "pagoda:generation_tokens_total")
    assert expected - generated_before >= generated
    wait_for(prometheus, "sum(pagoda:generation_tokens_total)", lambda v: v == expected, "generation counter caught up")
    wait_for(prometheus, "sum(pagoda:num_requests_running)", lambda v: v == 0, "running back to 0 when idle")
    wait_for(prometheus, "sum(pagoda:kv_cache_usage_perc)", lambda v: v == 0, "KV usage back to 0 when idle")
    wait_for(prometheus, 'sum(pagoda:request_success_total{finished_reason="length"})', lambda v: v >= 5,
             "finished requests counted by reason")
    wait_for(prometheus, "sum(pagoda:time_to_first_token_seconds_count)", lambda v: v >= ttft_count_before + 5,
             "TTFT observed for every request")
    wait_for(prometheus, "sum(rate(pagoda:generation_tokens_total[1m]))", lambda v: v > 0, "tokens/s above 0")


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$model_name", ".*").replace("$__rate_interval", "1m")
            out.append((f"{panel['title']} {target['refId']}", expr))
    return out


@pytest.mark.skipif(PROMETHEUS is None, reason=NOT_INSTALLED)
def test_every_dashboard_query_runs_and_has_data(pagoda, prometheus):
    """Prometheus accepts each panel's PromQL and, after the traffic above, returns a series."""
    complete(pagoda, 8)  # in case this test runs alone
    expected = pagoda_value(pagoda, "pagoda:generation_tokens_total")
    wait_for(prometheus, "sum(pagoda:generation_tokens_total)", lambda v: v == expected, "scraped after traffic")
    empty = [name for name, expr in dashboard_queries() if not query(prometheus, expr)]
    assert not empty, f"dashboard queries with no data after traffic: {empty}"

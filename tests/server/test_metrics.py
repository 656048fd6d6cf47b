"""Metrics as a Prometheus scraper sees them: feed StepStats, parse render()."""

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import FinishedRequestStats, StepStats
from server.metrics import Metrics, build_1_2_5_buckets

MODEL = "test-model"
ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"
CONTRACT_START = "The metrics contract"

GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
          "kv_cache_tail_waste_tokens"]
COUNTERS = ["prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
            "prefix_cache_queries", "prefix_cache_hits", "http_requests_client_disconnected"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total"]


def scrape(metrics: Metrics) -> dict[str, list]:
    """sample name -> [(labels, value), ...] as a scraper would read them."""
    body, content_type = metrics.render()
    assert isinstance(body, bytes)
    assert content_type.startswith("text/plain")
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples, name, **labels):
    labels = {"model_name": MODEL, **labels}
    hits = [v for lab, v in samples[name] if lab == labels]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


def bucket(samples, name, le):
    return value(samples, name + "_bucket", le=le)


def finished(reason="stop", prompt=10, gen=5, e2e=1.2, queue=0.05):
    return FinishedRequestStats(finish_reason=reason, num_prompt_tokens=prompt,
                                num_generation_tokens=gen, e2e_latency_s=e2e,
                                queue_time_s=queue)


def idle():
    return StepStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                     kv_cache_tail_waste_tokens=0, num_scheduled_tokens=0)


@pytest.fixture
def metrics():
    return Metrics(MODEL, max_model_len=2048)


def test_every_contract_metric_is_exposed_from_the_start(metrics):
    text = metrics.render()[0].decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    for n in GAUGES + HISTOGRAMS:
        assert "pagoda:" + n in names
    for n in COUNTERS:
        # prometheus_client exposes counters with a _total suffix, like vLLM
        assert f"pagoda:{n}_total" in text
    samples = scrape(metrics)
    for n in GAUGES:
        assert value(samples, "pagoda:" + n) == 0
    for n in COUNTERS:
        if n != "request_success":
            assert value(samples, f"pagoda:{n}_total") == 0
    for reason in ("stop", "length", "abort"):
        assert value(samples, "pagoda:request_success_total", finished_reason=reason) == 0
    for n in HISTOGRAMS:
        assert value(samples, f"pagoda:{n}_count") == 0


def test_architecture_doc_lists_the_contract_metrics():
    """docs/ARCHITECTURE.md's metrics-contract paragraph names exactly the series exposed."""
    text = ARCHITECTURE.read_text()
    section = text[text.index(CONTRACT_START):]
    section = section[: section.index("\n\n")]
    declared = set(re.findall(r"`([a-z0-9_]+)(?:\{[a-z_]+\})?`", section))
    assert declared == set(GAUGES + COUNTERS + HISTOGRAMS)
    exposed = Metrics(MODEL).render()[0].decode()
    for name in declared:
        assert re.search(rf"^pagoda:{name}(_total|_bucket)?\{{", exposed, re.M), name


def test_every_series_has_model_name_label(metrics):
    metrics.on_step(StepStats(num_running=1, num_waiting=0, kv_cache_usage=0.1,
                              kv_cache_tail_waste_tokens=3, num_scheduled_tokens=10,
                              num_prompt_tokens=10, time_to_first_token_s=[0.1],
                              finished=[finished()]))
    for name, rows in scrape(metrics).items():
        for labels, _ in rows:
            assert labels.get("model_name") == MODEL, name


def test_counters_accumulate_across_steps(metrics):
    metrics.on_step(StepStats(num_running=2, num_waiting=1, kv_cache_usage=0.25,
                              kv_cache_tail_waste_tokens=7, num_scheduled_tokens=30,
                              num_prompt_tokens=28, num_generation_tokens=2))
    metrics.on_step(StepStats(num_running=2, num_waiting=0, kv_cache_usage=0.3,
                              kv_cache_tail_waste_tokens=5, num_scheduled_tokens=12,
                              num_prompt_tokens=10, num_generation_tokens=3,
                              num_preemptions=1))
    metrics.on_step(StepStats(num_running=1, num_waiting=0, kv_cache_usage=0.2,
                              kv_cache_tail_waste_tokens=2, num_scheduled_tokens=1,
                              num_generation_tokens=1, num_preemptions=2))
    s = scrape(metrics)
    assert value(s, "pagoda:prompt_tokens_total") == 38
    assert value(s, "pagoda:generation_tokens_total") == 6
    assert value(s, "pagoda:num_preemptions_total") == 3


def test_gauges_follow_latest_step_and_return_to_zero(metrics):
    metrics.on_step(StepStats(num_running=3, num_waiting=4, kv_cache_usage=0.5,
                              kv_cache_tail_waste_tokens=11, num_scheduled_tokens=3))
    metrics.on_step(StepStats(num_running=2, num_waiting=1, kv_cache_usage=0.375,
                              kv_cache_tail_waste_tokens=9, num_scheduled_tokens=2))
    s = scrape(metrics)
    assert value(s, "pagoda:num_requests_running") == 2
    assert value(s, "pagoda:num_requests_waiting") == 1
    assert value(s, "pagoda:kv_cache_usage_perc") == 0.375
    assert value(s, "pagoda:kv_cache_tail_waste_tokens") == 9
    metrics.on_step(idle())
    s = scrape(metrics)
    for n in GAUGES:
        assert value(s, "pagoda:" + n) == 0


def test_latency_histograms(metrics):
    metrics.on_step(StepStats(num_running=2, num_waiting=0, kv_cache_usage=0.1,
                              kv_cache_tail_waste_tokens=0, num_scheduled_tokens=20,
                              num_prompt_tokens=20, num_generation_tokens=2,
                              time_to_first_token_s=[0.003, 0.3]))
    metrics.on_step(StepStats(num_running=2, num_waiting=0, kv_cache_usage=0.1,
                              kv_cache_tail_waste_tokens=0, num_scheduled_tokens=2,
                              num_generation_tokens=2, inter_token_latency_s=[0.02, 0.2]))
    metrics.on_step(StepStats(num_running=1, num_waiting=0, kv_cache_usage=0.1,
                              kv_cache_tail_waste_tokens=0, num_scheduled_tokens=1,
                              num_generation_tokens=1, inter_token_latency_s=[0.06]))
    s = scrape(metrics)
    ttft = "pagoda:time_to_first_token_seconds"
    assert value(s, ttft + "_count") == 2
    assert value(s, ttft + "_sum") == pytest.approx(0.303)
    assert bucket(s, ttft, "0.001") == 0
    assert bucket(s, ttft, "0.005") == 1
    assert bucket(s, ttft, "0.25") == 1
    assert bucket(s, ttft, "0.5") == 2
    assert bucket(s, ttft, "+Inf") == 2
    itl = "pagoda:inter_token_latency_seconds"
    assert value(s, itl + "_count") == 3
    assert value(s, itl + "_sum") == pytest.approx(0.28)
    assert bucket(s, itl, "0.025") == 1
    assert bucket(s, itl, "0.075") == 2
    assert bucket(s, itl, "0.2") == 3
    it = "pagoda:iteration_tokens_total"
    assert value(s, it + "_count") == 3
    assert value(s, it + "_sum") == 23


def test_finished_requests(metrics):
    metrics.on_step(StepStats(
        num_running=0, num_waiting=0, kv_cache_usage=0.0, kv_cache_tail_waste_tokens=0,
        num_scheduled_tokens=2, num_generation_tokens=2,
        finished=[finished("stop", prompt=10, gen=5, e2e=1.2, queue=0.05),
                  finished("length", prompt=100, gen=16, e2e=3.0, queue=0.4)]))
    # abort of a request that never ran: 0-token report, no queue time
    metrics.on_step(StepStats(
        num_running=0, num_waiting=0, kv_cache_usage=0.0, kv_cache_tail_waste_tokens=0,
        num_scheduled_tokens=0,
        finished=[finished("abort", prompt=7, gen=0, e2e=0.5, queue=None)]))
    metrics.on_step(StepStats(
        num_running=0, num_waiting=0, kv_cache_usage=0.0, kv_cache_tail_waste_tokens=0,
        num_scheduled_tokens=1, num_generation_tokens=1,
        finished=[finished("stop", prompt=3, gen=1, e2e=0.2, queue=0.01)]))
    s = scrape(metrics)
    rs = "pagoda:request_success_total"
    assert value(s, rs, finished_reason="stop") == 2
    assert value(s, rs, finished_reason="length") == 1
    assert value(s, rs, finished_reason="abort") == 1

    e2e = "pagoda:e2e_request_latency_seconds"
    assert value(s, e2e + "_count") == 4
    assert value(s, e2e + "_sum") == pytest.approx(4.9)
    assert bucket(s, e2e, "0.3") == 1
    assert bucket(s, e2e, "7680.0") == 4
    q = "pagoda:request_queue_time_seconds"
    assert value(s, q + "_count") == 3  # the never-scheduled abort is skipped
    assert value(s, q + "_sum") == pytest.approx(0.46)
    pt = "pagoda:request_prompt_tokens"
    assert value(s, pt + "_count") == 4
    assert value(s, pt + "_sum") == 120
    assert bucket(s, pt, "5.0") == 1
    assert bucket(s, pt, "10.0") == 3
    assert bucket(s, pt, "100.0") == 4
    gt = "pagoda:request_generation_tokens"
    assert value(s, gt + "_count") == 4
    assert value(s, gt + "_sum") == 22
    assert bucket(s, gt, "1.0") == 2
    # the 0-token abort report is not an iteration
    assert value(s, "pagoda:iteration_tokens_total_count") == 2
    assert value(s, "pagoda:iteration_tokens_total_sum") == 3


def test_disconnect_and_prefix_cache_counters(metrics):
    metrics.record_client_disconnect()
    metrics.record_client_disconnect()
    metrics.record_prefix_cache(queries=64, hits=16)
    metrics.record_prefix_cache(queries=32, hits=0)
    s = scrape(metrics)
    assert value(s, "pagoda:http_requests_client_disconnected_total") == 2
    assert value(s, "pagoda:prefix_cache_queries_total") == 96
    assert value(s, "pagoda:prefix_cache_hits_total") == 16


def test_token_buckets_follow_max_model_len():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    s = scrape(Metrics(MODEL, max_model_len=512))
    les = [lab["le"] for lab, _ in s["pagoda:request_prompt_tokens_bucket"]]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0",
                   "500.0", "+Inf"]


def test_instances_are_independent_and_share_registry_on_request():
    a, b = Metrics(MODEL), Metrics(MODEL)
    a.record_client_disconnect()
    assert value(scrape(b), "pagoda:http_requests_client_disconnected_total") == 0
    reg = CollectorRegistry()
    m = Metrics(MODEL, registry=reg)
    assert m.registry is reg
    with pytest.raises(ValueError):  # duplicate names in one registry
        Metrics(MODEL, registry=reg)


# ---- the gateways' contract under vLLM's names (server/metrics_vllm.py) --------------------

VLLM_TYPES = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "kv_cache_usage_perc": "gauge",
    "gpu_cache_usage_perc": "gauge", "cache_config_info": "gauge", "prompt_tokens": "counter",
    "generation_tokens": "counter", "request_success": "counter", "num_preemptions": "counter",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "time_per_output_token_seconds": "histogram", "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram", "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram", "iteration_tokens_total": "histogram",
}


def families(body: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def test_vllm_names_carry_the_same_values_as_pagodas(metrics):
    """One recording, two names: every contract series under vllm: equals its pagoda: twin."""
    metrics.set_cache_config(16, 364, "auto", True)
    metrics.on_step(StepStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, kv_cache_tail_waste_tokens=1,
                              num_scheduled_tokens=40, num_prompt_tokens=37, num_generation_tokens=3,
                              prefix_cache_queries=48, prefix_cache_hits=32, time_to_first_token_s=[0.07],
                              inter_token_latency_s=[0.02], finished=[finished()]))
    found = families(metrics.render()[0])
    twins = {"gpu_cache_usage_perc": "kv_cache_usage_perc", "time_per_output_token_seconds": "inter_token_latency_seconds"}
    for name, kind in VLLM_TYPES.items():
        family = found["vllm:" + name]
        assert family.type == kind, name
        ours = found["pagoda:" + twins.get(name, name)]
        strip = lambda samples, prefix: sorted((s.name[len(prefix):], tuple(sorted(s.labels.items())), s.value)  # noqa: E731
                                                for s in samples if not s.name.endswith("_created"))
        theirs = [(n.replace(twins.get(name, name), name, 1), labels, v) for n, labels, v in strip(ours.samples, "pagoda:")]
        assert strip(family.samples, "vllm:") == sorted(theirs), name
    assert value(scrape(metrics), "vllm:kv_cache_usage_perc") == 0.25
    assert value(scrape(metrics), "vllm:prefix_cache_hits_total") == 32
    info = scrape(metrics)["vllm:cache_config_info"]
    assert info == [({"model_name": MODEL, "block_size": "16", "num_gpu_blocks": "364", "cache_dtype": "auto",
                      "enable_prefix_caching": "True"}, 1.0)]
    # Pagoda's own series stay pagoda:-only.
    assert "vllm:kv_cache_tail_waste_tokens" not in found and "vllm:http_requests_client_disconnected" not in found


def test_a_real_server_exposes_the_contract(server_url, model_name):
    """What a gateway scrapes from a running server: each vllm: series with its type, the
    model_name label, values in range, counters that rise with a request."""
    import httpx

    def scrape_server() -> dict:
        return families(httpx.get(f"{server_url}/metrics", timeout=30).content)

    before = scrape_server()
    r = httpx.post(f"{server_url}/v1/completions", json={"model": model_name, "prompt": "Hello there", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200, r.text
    after = scrape_server()
    for name, kind in VLLM_TYPES.items():
        assert after["vllm:" + name].type == kind, name
        assert all(s.labels.get("model_name") == model_name for s in after["vllm:" + name].samples), name

    def one(found, name):
        """A sample's value (0 where a counter has none yet), by its scraped name."""
        samples = [s for s in found[name.removesuffix("_total")].samples if s.name == name]
        assert len(samples) <= 1 and (samples or name.endswith("_total")), name
        return samples[0].value if samples else 0

    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert one(after, gauge) >= 0 and one(after, gauge) == int(one(after, gauge))
    assert 0.0 <= one(after, "vllm:kv_cache_usage_perc") <= 1.0
    for counter, at_least in (("vllm:prompt_tokens_total", r.json()["usage"]["prompt_tokens"]),
                              ("vllm:generation_tokens_total", 3), ("vllm:prefix_cache_queries_total", 1)):
        assert one(after, counter) - one(before, counter) >= at_least, counter
    (info,) = after["vllm:cache_config_info"].samples
    assert int(info.labels["block_size"]) >= 1 and int(info.labels["num_gpu_blocks"]) > 0 and info.value == 1

"""End-to-end fixtures: the real `pagoda serve` as a subprocess on a free port
(tests/processes.py, over loadtest/processes.py).

Each server process (with a small KV cache: tests/processes.py TEST_KV_CACHE_GIB) costs 7-9 s
to start and ~1.4 GB: one is shared by the whole session (`server_url`); a module that needs
other flags starts its own and stops it when it ends.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from processes import TEST_KV_CACHE_GIB, Server, pagoda_command
from prometheus_client.parser import text_string_to_metric_families

MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 2 * 1024 * 1024
STARTUP_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def start_server(default_model_path, tmp_path_factory):
    """Factory: start a server with extra flags, wait for /health; all stopped at session end.

    Depends on `default_model_path` so the one-time model conversion happens here, outside
    the server's start-up timeout.
    """
    started: list[Server] = []
    # Logs under pytest's basetemp (the last runs are kept), for reading after a failure.
    log_dir = tmp_path_factory.mktemp("server-logs")

    def start(extra_args: list[str] = ()) -> Server:
        server = Server("pagoda-serve", pagoda_command(
            "--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", str(MAX_BODY_BYTES),
            # What "auto" is on a CPU, fixed so that comparisons with a float32 Hugging Face
            # forward pass hold on any machine.
            "--dtype", "float32", "--kv-cache-memory", str(TEST_KV_CACHE_GIB), *extra_args), log_dir)
        started.append(server)
        server.wait_ready(STARTUP_TIMEOUT_S)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server) -> Server:
    return start_server([])


@pytest.fixture(scope="session")
def server_url(server) -> str:
    return server.url


@pytest.fixture(scope="session")
def model_name(server_url) -> str:
    r = httpx.get(f"{server_url}/v1/models", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["id"]


@pytest.fixture(scope="session")
def client(server_url) -> openai.OpenAI:
    # max_retries=0: a retried request would hide the status the server first answered.
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture
def async_client_factory(server_url):
    """AsyncOpenAI binds its connection pool to the loop it first runs in: make one per loop."""

    def make() -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="x", max_retries=0, timeout=120)

    return make


# ---- helpers shared by the test modules (imported as fixtures, since tests have no package) --


def tokenize(url: str, model: str, text: str) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def detokenize(url: str, model: str, token_ids: list[int]) -> str:
    r = httpx.post(f"{url}/detokenize", json={"model": model, "tokens": token_ids}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def scrape_metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """Sample name -> value summed over label sets (every sample carries `model_name`)."""
    r = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10)
    assert r.status_code == 200, r.text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


RUNNING = "pagoda:num_requests_running"
WAITING = "pagoda:num_requests_waiting"
KV_USAGE = "pagoda:kv_cache_usage_perc"


def idle(metrics: dict[str, float]) -> bool:
    """Nothing running or waiting, and every KV block free."""
    return metrics.get(RUNNING) == 0 and metrics.get(WAITING) == 0 and metrics.get(KV_USAGE) == 0


def wait_idle(url: str, until=idle, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until `until(metrics)` holds; the last scrape (the caller asserts on it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape_metrics(url)
        if until(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def parse_sse(lines) -> list:
    """`data: ...` payloads of an SSE body, JSON-decoded except the final `[DONE]`."""
    events = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error_envelope(body: dict) -> dict:
    """The OpenAI error envelope: {"error": {message: str, type: str, param: str|None, code: str|None}}."""
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], err
    assert isinstance(err.get("type"), str) and err["type"], err
    assert "param" in err and (err["param"] is None or isinstance(err["param"], str)), err
    assert "code" in err and (err["code"] is None or isinstance(err["code"], str)), err
    return err


@pytest.fixture(scope="session")
def helpers():
    """The module-level helpers above, for test modules (conftest is not importable by name)."""

    class H:
        tokenize = staticmethod(tokenize)
        detokenize = staticmethod(detokenize)
        scrape_metrics = staticmethod(scrape_metrics)
        idle = staticmethod(idle)
        wait_idle = staticmethod(wait_idle)
        parse_sse = staticmethod(parse_sse)
        assert_error_envelope = staticmethod(assert_error_envelope)
        MAX_MODEL_LEN = MAX_MODEL_LEN
        MAX_BODY_BYTES = MAX_BODY_BYTES

    return H

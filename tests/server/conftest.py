"""End-to-end fixtures: the real `pagoda serve` as a subprocess on a free port.

Each server process costs a few seconds and ~1 GB, so there are two at most: one shared
by the whole session (`server_url`) and one with `--api-key` for the auth module.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 2 * 1024 * 1024
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `pagoda serve` subprocess; its stdout+stderr go to a log file read on failure."""

    def __init__(self, extra_args: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable, "-m", "server.cli", "serve",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-body-bytes", str(MAX_BODY_BYTES),
            # What "auto" is on a CPU, fixed so that comparisons with a float32 Hugging Face
            # forward pass hold on any machine.
            "--dtype", "float32",
            *extra_args,
        ]
        # A file, not a pipe: a chatty server must never block on a full pipe buffer.
        # Kept under pytest's basetemp (the last runs are kept) for reading after a failure.
        self.log_path = log_dir / f"pagoda-serve-{self.port}.log"
        self.log = open(self.log_path, "wb")
        # the key comes from the flags only, never from the environment of whoever runs the tests
        env = {k: v for k, v in os.environ.items() if k != "PAGODA_API_KEY"}
        self.proc = subprocess.Popen(
            self.args, cwd=REPO_ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )

    def log_tail(self, num_chars: int = 6000) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace")
        return text[-num_chars:]

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                pytest.fail(
                    f"`{' '.join(self.args)}` exited with {rc} before /health answered 200;"
                    f" its output:\n{self.log_tail()}",
                    pytrace=False,
                )
            try:
                r = httpx.get(f"{self.url}/health", timeout=2.0)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.25)
        self.stop()
        pytest.fail(
            f"/health did not answer 200 within {timeout_s:.0f} s (last: {last}); server output:\n"
            f"{self.log_tail()}",
            pytrace=False,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="session")
def start_server(default_model_path, tmp_path_factory):
    """Factory: start a server with extra flags, wait for /health; all stopped at session end.

    Depends on `default_model_path` so the one-time model conversion happens here, outside
    the server's start-up timeout.
    """
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def start(extra_args: list[str] = ()) -> ServerProcess:
        server = ServerProcess(list(extra_args), log_dir)
        started.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server) -> ServerProcess:
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
        parse_sse = staticmethod(parse_sse)
        assert_error_envelope = staticmethod(assert_error_envelope)
        MAX_MODEL_LEN = MAX_MODEL_LEN
        MAX_BODY_BYTES = MAX_BODY_BYTES

    return H

"""A real LLM gateway in front of Pagoda: SMG (`pip install smg`, the SGLang model gateway's
successor, a prebuilt Rust binary) with its cache-aware policy over two `pagoda serve`
replicas on loopback, started and stopped here.

SMG reads the replicas' health and the vLLM-named load metrics (server/metrics_vllm.py),
routes completions and chats to them, and retries a request whose replica died: after one
replica is SIGKILLed, every non-streamed request sent through SMG still succeeds. Skips,
saying why, where the smg binary is not installed (it is in the test extra)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from processes import PORT, Server, free_port, pagoda_command

SMG = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
pytestmark = pytest.mark.skipif(not Path(SMG).is_file(), reason="the smg gateway is not installed (pip install smg)")
STARTUP_TIMEOUT_S = 180.0


def replica(log_dir: Path) -> Server:
    return Server("replica", pagoda_command(
        "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory", "0.1",
        "--no-access-log",
    ), log_dir, env={"OMP_NUM_THREADS": "1"})  # two replicas share the cores: one thread each


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("smg")
    replicas = [replica(log_dir), replica(log_dir)]
    smg = None
    try:
        for r in replicas:
            r.wait_ready(STARTUP_TIMEOUT_S)
        smg = Server("smg", [SMG, "launch", "--host", "127.0.0.1", "--port", PORT, "--policy", "cache_aware",
                             # Its own metrics on a free loopback port (default: 0.0.0.0:29000).
                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                             "--worker-urls", *[r.url for r in replicas]], log_dir)
        smg.wait_ready(60)
        yield smg, replicas
    finally:
        for process in [smg, *replicas]:
            if process is not None:
                process.stop()


def finished(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:request_success_total")


def complete(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 3},
                      timeout=120)


def test_smg_routes_to_the_replicas_and_retries_past_a_dead_one(gateway):
    smg, replicas = gateway
    models = httpx.get(f"{smg.url}/v1/models", timeout=30)
    assert models.status_code == 200, models.text
    before = [finished(r) for r in replicas]
    for i in range(4):
        r = complete(smg.url, f"Request number {i} says")
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    chat = httpx.post(f"{smg.url}/v1/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert chat.status_code == 200, chat.text
    # The replicas served them: their own counters (vLLM's names, which SMG scrapes) rose by 5.
    assert sum(finished(r) for r in replicas) - sum(before) == 5

    replicas[1].kill()  # SIGKILL: connections refused from now on
    statuses = [complete(smg.url, f"After the kill {i}").status_code for i in range(6)]
    assert statuses == [200] * 6, f"{statuses}; smg log:\n{smg.log_tail()}"

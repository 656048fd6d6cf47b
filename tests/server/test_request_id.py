"""X-Request-Id through the shared server (server/request_id.py): the client's id echoed and
carried into the response id (as vLLM's `chatcmpl-<id>`), a fresh one when none is sent,
two running requests with one id both served, a bad id a 400 naming the header."""

from __future__ import annotations

import asyncio

import httpx
import pytest


def test_the_clients_id_is_echoed_and_names_the_response(server_url, model_name):
    for path, body, prefix in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "chatcmpl-"),
        ("/v1/completions", {"prompt": "Hi"}, "cmpl-"),
    ):
        r = httpx.post(f"{server_url}{path}", json={"model": model_name, "max_tokens": 2, **body},
                       headers={"X-Request-Id": "gw-trace-42"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "gw-trace-42"
        assert r.json()["id"] == prefix + "gw-trace-42"
        # Streamed: every chunk carries the id.
        with httpx.stream("POST", f"{server_url}{path}", json={"model": model_name, "max_tokens": 2, "stream": True,
                                                               **body},
                          headers={"X-Request-Id": "gw-trace-43"}, timeout=60) as s:
            assert s.headers["x-request-id"] == "gw-trace-43"
            chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks and all(f'"id":"{prefix}gw-trace-43"' in c for c in chunks)


def test_without_one_a_fresh_id_comes_back(server_url, model_name):
    ids = {httpx.get(f"{server_url}/v1/models", timeout=10).headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)


def test_two_running_requests_may_share_an_id(server_url, model_name):
    async def both():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[
                client.post(f"{server_url}/v1/completions", headers={"X-Request-Id": "same"},
                            json={"model": model_name, "prompt": "Count: one two", "max_tokens": 24, "ignore_eos": True})
                for _ in range(2)])

    for r in asyncio.run(both()):
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "cmpl-same" and r.json()["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("value", ["has space", "x" * 129, "tab\there", "caf\u00e9"])
def test_a_bad_id_is_a_400_naming_the_header(server_url, model_name, value):
    r = httpx.post(f"{server_url}/v1/completions", json={"model": model_name, "prompt": "Hi"},
                   headers=[("X-Request-Id", value.encode("utf-8"))], timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "X-Request-Id"

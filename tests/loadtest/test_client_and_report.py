"""The client's error kinds, fixed-length negotiation and the side-by-side report, against
fake servers (httpx.MockTransport) and a closed port: no model needed."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from loadtest import compat, report
from loadtest.client import RequestParams, RequestResult, send_request
from loadtest.datasets import BenchRequest
from loadtest.processes import free_port
from loadtest.summary import summarize

REQ = BenchRequest(4, prompt="Hello")


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def completion_stream(tokens: int = 4, done: bool = True, usage: bool = True) -> bytes:
    events: list = [{"choices": [{"index": 0, "text": f"t{i}"}]} for i in range(tokens)]
    events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                   **({"usage": {"prompt_tokens": 2, "completion_tokens": tokens}} if usage else {})})
    if done:
        events.append("[DONE]")
    return sse(*events)


def run(handler, req=REQ, params=None) -> RequestResult:
    async def go():
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            return await send_request(client, req, params or RequestParams(model="m"), time.perf_counter())

    return asyncio.run(go())


def test_a_good_stream():
    r = run(lambda request: httpx.Response(200, content=completion_stream(4)))
    assert r.ok and r.output_tokens == 4 and r.prompt_tokens == 2 and r.tokens_from_usage
    assert r.ttft_s is not None and len(r.itl_s) == 3 and r.finish_reason == "length"


def test_no_usage_counts_chunks_and_no_done_is_fine_after_a_finish_reason():
    r = run(lambda request: httpx.Response(200, content=completion_stream(3, done=False, usage=False)))
    assert r.ok and r.output_tokens == 3 and not r.tokens_from_usage


def test_chat_chunks_count_content_only():
    events = [{"choices": [{"delta": {"role": "assistant"}}]}, {"choices": [{"delta": {"content": "a"}}]},
              {"choices": [{"delta": {"content": "b"}, "finish_reason": "stop"}]}, "[DONE]"]
    r = run(lambda request: httpx.Response(200, content=sse(*events)),
            req=BenchRequest(4, messages=({"role": "user", "content": "hi"},)))
    assert r.ok and r.output_tokens == 2 and len(r.itl_s) == 1


@pytest.mark.parametrize("status", [400, 422, 503])
def test_http_errors_by_status(status):
    body = {"error": {"message": "queue full", "type": "x", "param": None, "code": None}}
    r = run(lambda request: httpx.Response(status, json=body))
    assert not r.ok and r.error_kind == f"http_{status}" and r.error == "queue full"


def test_error_event_in_the_stream():
    content = sse({"choices": [{"text": "a"}]}, {"error": {"message": "engine died"}}, "[DONE]")
    r = run(lambda request: httpx.Response(200, content=content))
    assert r.error_kind == "stream_error" and "engine died" in r.error


def test_a_stream_cut_short():
    r = run(lambda request: httpx.Response(200, content=sse({"choices": [{"text": "a"}]})))
    assert r.error_kind == "incomplete_stream"


def test_a_closed_port_is_a_connect_error_at_once():
    async def go():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{free_port()}") as client:
            return await send_request(client, REQ, RequestParams(model="m"), time.perf_counter())

    t0 = time.monotonic()
    r = asyncio.run(go())
    assert r.error_kind == "connect_error" and time.monotonic() - t0 < 5


def test_request_timeout_bounds_a_stalled_server():
    async def stall(request):
        await asyncio.sleep(30)

    r = run(stall, params=RequestParams(model="m", request_timeout_s=0.2))
    assert r.error_kind == "timeout" and r.e2e_s < 5


class FakeServer:
    """Accepts only the listed extra fields (like transformers serve: 422 for the others)."""

    def __init__(self, known: set[str]) -> None:
        self.known = known
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        base = {"model", "prompt", "messages", "max_tokens", "temperature", "stream"}
        unexpected = set(body) - base - self.known
        if unexpected:
            return httpx.Response(422, json={"detail": f"Unexpected fields in the request: {unexpected}"})
        return httpx.Response(200, content=completion_stream(body["max_tokens"]))


def negotiate(server: FakeServer, want_fixed_length: bool = True) -> compat.Negotiated:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server), base_url="http://fake") as client:
            return await compat.negotiate(client, RequestParams(model="m"), REQ, want_fixed_length)

    return asyncio.run(go())


@pytest.mark.parametrize("known,mode,num_rejected", [
    ({"stream_options", "ignore_eos", "min_tokens"}, "ignore_eos", 0),
    ({"stream_options", "min_tokens"}, "min_tokens", 1),
    ({"stream_options", "generation_config"}, "generation_config", 2),  # transformers serve
    ({"stream_options"}, "none", 3),
])
def test_negotiation_picks_the_first_accepted_fixed_length_field(known, mode, num_rejected):
    result = negotiate(FakeServer(known))
    assert result.mode.name == mode and result.include_usage
    assert len(result.rejected) == num_rejected and all("http_422" in r for r in result.rejected)


def test_negotiation_drops_stream_options_when_refused():
    server = FakeServer({"ignore_eos"})
    result = negotiate(server)
    assert (result.mode.name, result.include_usage) == ("ignore_eos", False)
    assert "stream_options" not in server.bodies[-1]


def test_negotiation_sends_nothing_extra_when_lengths_may_vary():
    server = FakeServer({"stream_options", "ignore_eos"})
    assert negotiate(server, want_fixed_length=False).mode.name == "none"
    assert all("ignore_eos" not in b for b in server.bodies)


class RefuseAll(FakeServer):
    def __call__(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "model not found"})


def test_negotiation_gives_up_on_a_server_that_refuses_everything():
    with pytest.raises(ConnectionError, match="refuses a plain streamed request.*model not found"):
        negotiate(RefuseAll(set()))


def _server(name: str, tok_s: float, itl_ms: float, mode: str) -> dict:
    tokens = 10
    e2e = tokens / tok_s
    results = [RequestResult(ok=True, start_s=0, e2e_s=e2e, ttft_s=0.05, itl_s=[itl_ms / 1000] * 9,
                             output_tokens=tokens, max_tokens=tokens)]
    summary = summarize(results, wall_s=e2e)
    return {"name": name, "url": "http://x", "command": f"{name} serve", "model": "m", "request_mode": mode,
            "request_note": mode, "rejected": [], "error": None,
            "runs": [{"label": "concurrency 1", "summary": summary, "server_metrics": None}]}


def test_side_by_side_table_has_ratios_and_says_how_each_peer_was_asked():
    doc = {
        "title": None, "created_utc": "2026-01-01 00:00", "command": "python -m loadtest --peers",
        "environment": {"machine": "test"},
        "workload": {"dataset": {"dataset": "random", "input_len": "8", "output_len": "10", "tokenizer": "words"},
                     "num_prompts": "1", "warmup": 0, "temperature": 0.0, "fixed_length": True, "slos_ms": {}},
        "servers": [_server("pagoda", 300.0, 20.0, "ignore_eos"), _server("transformers serve", 100.0, 40.0, "generation_config")],
        "skipped": [{"name": "llama.cpp", "reason": "not installed"}],
        "plots": [],
    }
    text = report.markdown(doc)
    row = next(line for line in text.splitlines() if line.startswith("| concurrency 1 | transformers serve |"))
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
    assert cells[4] == "3.00x" and cells[7] == "0.50x" and cells[-1] == "generation_config"
    assert "## Side by side" in text and "- llama.cpp: not installed" in text
    assert "No server-side figures" in text

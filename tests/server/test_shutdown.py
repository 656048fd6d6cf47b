"""SIGTERM with requests in flight: the short ones finish, the long ones end with "abort",
new requests are refused with 503, and the process exits 0 (server/shutdown.py)."""

import asyncio
import signal

import httpx
import pytest

SHUTDOWN_TIMEOUT_S = 12
SHORT_TOKENS = 24  # done within the drain even on a busy 2-core machine
LONG_TOKENS = 1800  # minutes of decoding on a CPU: cut by the drain


@pytest.fixture
def doomed_server(start_server):
    """A server of its own: this test ends it."""
    return start_server(["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--max-model-len", "2048"])


def _body(model, i, max_tokens, stream):
    return {"model": model, "prompt": f"{i}. Count from one to one thousand:", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def test_sigterm_drains_then_aborts_then_exits_0(doomed_server, helpers):
    url = doomed_server.url
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    # (max_tokens, stream) of the requests in flight at SIGTERM
    plan = [(SHORT_TOKENS, True), (SHORT_TOKENS, False), (LONG_TOKENS, True), (LONG_TOKENS, True),
            (LONG_TOKENS, False), (LONG_TOKENS, False)]

    async def stream(http, i, max_tokens, started):
        async with http.stream("POST", "/v1/completions", json=_body(model, i, max_tokens, True)) as r:
            assert r.status_code == 200, await r.aread()
            events = []
            async for line in r.aiter_lines():
                events += helpers.parse_sse([line])
                if len(events) == 1:
                    started.set()
            return events

    async def non_stream(http, i, max_tokens):
        r = await http.post("/v1/completions", json=_body(model, i, max_tokens, False))
        assert r.status_code == 200, r.text
        return r.json()

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            started = [asyncio.Event() for _ in plan]
            tasks = []
            for i, (max_tokens, is_stream) in enumerate(plan):
                if is_stream:
                    tasks.append(asyncio.create_task(stream(http, i, max_tokens, started[i])))
                else:
                    started[i].set()
                    tasks.append(asyncio.create_task(non_stream(http, i, max_tokens)))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            # every request is in the engine (the non-streaming ones too) before the signal
            for _ in range(600):
                m = helpers.scrape_metrics(url)
                if m["pagoda:num_requests_running"] + m["pagoda:num_requests_waiting"] == len(plan):
                    break
                await asyncio.sleep(0.1)
            assert not any(t.done() for t in tasks), "a request ended before SIGTERM"
            doomed_server.proc.send_signal(signal.SIGTERM)

            # /health turns 503 once the drain began; a new request is then refused
            async with httpx.AsyncClient(base_url=url, timeout=30) as fresh:
                for _ in range(300):
                    health = await fresh.get("/health")
                    if health.status_code == 503:
                        break
                    await asyncio.sleep(0.05)
                assert health.status_code == 503, health.text
                assert helpers.assert_error_envelope(health.json())["code"] == "server_draining"
                refused = await fresh.post("/v1/completions", json=_body(model, 99, 4, False))
            return await asyncio.gather(*tasks), health, refused

    results, health, refused = asyncio.run(run())
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["retry-after"]) >= 0
    assert helpers.assert_error_envelope(refused.json())["code"] == "server_draining"

    for (max_tokens, is_stream), result in zip(plan, results):
        if is_stream:
            assert result[-1] == "[DONE]", result[-3:]
            assert not any("error" in e for e in result[:-1]), result[-3:]
            finishes = [c["finish_reason"] for e in result[:-1] for c in e["choices"] if c.get("finish_reason")]
            text = "".join(c["text"] for e in result[:-1] for c in e["choices"])
        else:
            finishes = [c["finish_reason"] for c in result["choices"]]
            text = result["choices"][0]["text"]
            num_tokens = result["usage"]["completion_tokens"]
        if max_tokens == SHORT_TOKENS:
            assert finishes == ["length"], f"an in-flight request did not finish: {finishes}"
            if not is_stream:
                assert num_tokens == SHORT_TOKENS
        else:
            assert finishes == ["abort"], finishes
            assert text, "an aborted request keeps the text generated so far"
            if not is_stream:
                assert 0 < num_tokens < LONG_TOKENS

    assert doomed_server.proc.wait(timeout=60) == 0, doomed_server.log_tail()
    log = doomed_server.log_tail(200_000)
    assert "Traceback" not in log, log[-4000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)

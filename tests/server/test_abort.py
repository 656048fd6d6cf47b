"""Clients that go away: their requests are aborted, their KV blocks freed, and counted."""

import asyncio

import httpx

RUNNING = "pagoda:num_requests_running"
WAITING = "pagoda:num_requests_waiting"
KV_USAGE = "pagoda:kv_cache_usage_perc"
DISCONNECTED = "pagoda:http_requests_client_disconnected_total"
GENERATED = "pagoda:generation_tokens_total"


def test_40_streams_half_disconnected(server_url, model_name, helpers):
    before = helpers.wait_idle(server_url)
    assert helpers.idle(before), {k: before.get(k) for k in (RUNNING, WAITING, KV_USAGE)}
    assert DISCONNECTED in before, sorted(before)
    body = {"model": model_name, "prompt": "Count from one to one hundred:", "max_tokens": 64,
            "temperature": 0, "ignore_eos": True, "stream": True}

    async def stream(http, i, disconnect):
        async with http.stream("POST", "/v1/completions", json={**body, "prompt": f"{i}. {body['prompt']}"}) as r:
            assert r.status_code == 200, await r.aread()
            events = []
            async for line in r.aiter_lines():
                events += helpers.parse_sse([line])
                if disconnect and len(events) >= 2:
                    return events  # leaving the block closes the connection mid-stream
        return events

    async def run():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server_url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(stream(http, i, disconnect=i % 2 == 0) for i in range(40)))

    results = asyncio.run(run())
    for i, events in enumerate(results):
        if i % 2 == 0:
            assert len(events) == 2 and all(isinstance(e, dict) for e in events), events
        else:
            assert events[-1] == "[DONE]", events[-3:]
            assert not any("error" in e for e in events[:-1]), events
            finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")]
            assert finishes == ["length"]
    after = helpers.wait_idle(
        server_url, lambda m: helpers.idle(m) and m.get(DISCONNECTED, 0) - before[DISCONNECTED] >= 20
    )
    assert after[RUNNING] == 0 and after[WAITING] == 0, (after[RUNNING], after[WAITING])
    assert after[KV_USAGE] == 0, after[KV_USAGE]
    assert after[DISCONNECTED] - before[DISCONNECTED] >= 20, (before[DISCONNECTED], after[DISCONNECTED])
    # the completed half generated all its tokens; the dropped half stopped early
    generated = after[GENERATED] - before[GENERATED]
    assert 20 * 64 <= generated < 40 * 64, generated


def test_non_streaming_client_timeout_aborts_the_request(server_url, model_name, helpers):
    before = helpers.wait_idle(server_url)
    assert helpers.idle(before)
    max_tokens = 400
    body = {"model": model_name, "prompt": "Count from one to one hundred:", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}

    async def one(http, i):
        try:
            await http.post("/v1/completions", json={**body, "prompt": f"{i}. {body['prompt']}"})
        except httpx.ReadTimeout:
            return "gone"
        return "finished"

    async def run():
        timeout = httpx.Timeout(10.0, read=0.5)
        async with httpx.AsyncClient(base_url=server_url, timeout=timeout) as http:
            return await asyncio.gather(*(one(http, i) for i in range(4)))

    outcomes = asyncio.run(run())
    assert outcomes == ["gone"] * 4, "the server answered 400 tokens in 0.5 s: nothing to abort"
    after = helpers.wait_idle(
        server_url, lambda m: helpers.idle(m) and m.get(DISCONNECTED, 0) - before[DISCONNECTED] >= 4
    )
    assert helpers.idle(after), {k: after.get(k) for k in (RUNNING, WAITING, KV_USAGE)}
    assert after[DISCONNECTED] - before[DISCONNECTED] >= 4
    generated = after[GENERATED] - before[GENERATED]
    assert generated < 4 * max_tokens // 2, f"{generated} tokens generated for 4 abandoned requests"

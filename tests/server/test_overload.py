"""Overload: bounded queues (samples, then prompt tokens), per-request deadlines, and an
event loop that keeps answering while huge prompts tokenize.

One server with tight limits: 2 running sequences, 4 queue places, 300 queued prompt
tokens, 4 s in the queue, 12 s in all. The scenario's margins are seconds wide on purpose
(a request's fate never hangs on a few milliseconds); no test asserts a duration.
"""

import asyncio
import json
import random

import httpx
import pytest

from server.cli import main

MAX_WAITING_REQUESTS = 4
MAX_WAITING_TOKENS = 300
MAX_QUEUE_TIME_S = 4
REQUEST_TIMEOUT_S = 12
MAX_BODY_BYTES = 16 * 2**20
RUNNING = "pagoda:num_requests_running"
WAITING = "pagoda:num_requests_waiting"
KV_USAGE = "pagoda:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def tight_server(start_server):
    server = start_server([
        "--max-num-seqs", "2", "--max-model-len", "2048",
        "--max-waiting-requests", str(MAX_WAITING_REQUESTS), "--max-waiting-tokens", str(MAX_WAITING_TOKENS),
        "--max-queue-time", str(MAX_QUEUE_TIME_S), "--request-timeout", str(REQUEST_TIMEOUT_S),
        "--max-body-bytes", str(MAX_BODY_BYTES),
    ])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tight(tight_server):
    model = httpx.get(f"{tight_server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    return tight_server.url, model


def _aborted(url) -> float:
    r = httpx.get(f"{url}/metrics", timeout=10)
    return sum(float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
               if line.startswith("pagoda:request_success_total{") and 'finished_reason="abort"' in line)


def _huge_text(num_bytes: int) -> str:
    rng = random.Random(0)
    words = ["river", "stone", "lantern", "quartz", "meadow", "Zürich", "東京", "kettle", "42", "vortex"]
    parts, size = [], 0
    while size < num_bytes:
        word = rng.choice(words) + str(rng.randrange(1000))
        parts.append(word)
        size += len(word.encode()) + 1
    return " ".join(parts)


def test_health_answers_while_huge_prompts_tokenize(tight, helpers):
    """Two ~3 MiB prompts take seconds of tokenizer time each; /health must keep answering
    (a blocked event loop would leave these 3 s health checks hanging until it is done)."""
    url, model = tight
    text = _huge_text(3 * 2**20)
    completion = json.dumps({"model": model, "prompt": text, "max_tokens": 1})
    chat = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1})

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            huge = [
                asyncio.create_task(http.post(path, content=body, headers={"Content-Type": "application/json"}))
                for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat))
            ]
            answers = 0
            async with httpx.AsyncClient(base_url=url, timeout=3.0) as probe:
                while not all(t.done() for t in huge):
                    r = await probe.get("/health")  # raises httpx.TimeoutException if the loop is blocked
                    assert r.status_code == 200, r.text
                    answers += 1
                    await asyncio.sleep(0.05)
            return answers, await asyncio.gather(*huge)

    answers, responses = asyncio.run(run())
    assert answers >= 3, "the huge prompts were done before /health was asked: nothing was measured"
    for r in responses:
        assert r.status_code == 400, r.text[:300]
        assert helpers.assert_error_envelope(r.json())["code"] == "context_length_exceeded"


def _wait_metrics(helpers, url, until, timeout_s=60.0):
    async def poll():
        for _ in range(int(timeout_s / 0.1)):
            metrics = helpers.scrape_metrics(url)
            if until(metrics):
                return metrics
            await asyncio.sleep(0.1)
        return metrics

    return poll()


def test_queue_bounds_and_deadlines(tight, helpers):
    """Two long requests fill the running batch; then, in order:
    A (200 prompt tokens, streamed) queues; B (200 more) is refused for tokens; C (10)
    queues; D is refused for places before its (invalid) prompt is even tokenized.
    A and C leave the queue with queue_timeout; the two long ones end with request_timeout."""
    url, model = tight
    aborted_before = _aborted(url)
    long_body = {"model": model, "prompt": "Count from one to one thousand:", "max_tokens": 1900,
                 "temperature": 0, "ignore_eos": True}

    def ids(n, start):
        return [start + i for i in range(n)]

    async def sse(http, body):
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            return helpers.parse_sse([line async for line in r.aiter_lines()])

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            long_stream = asyncio.create_task(sse(http, long_body))
            long_plain = asyncio.create_task(http.post("/v1/completions", json=long_body))
            await _wait_metrics(helpers, url, lambda m: m[RUNNING] == 2)
            a = asyncio.create_task(sse(http, {"model": model, "prompt": ids(200, 1000), "max_tokens": 4}))
            await _wait_metrics(helpers, url, lambda m: m[WAITING] == 1)
            b = await http.post("/v1/completions", json={"model": model, "prompt": ids(200, 2000), "max_tokens": 4})
            c_body = {"model": model, "prompt": ids(10, 3000), "max_tokens": 4}
            c = asyncio.create_task(http.post("/v1/completions", json=c_body))
            await _wait_metrics(helpers, url, lambda m: m[WAITING] == 2)
            d = await http.post("/v1/completions", json={"model": model, "prompt": [10**7], "max_tokens": 4})
            return b, d, *(await asyncio.gather(a, c, long_stream, long_plain))

    b, d, a_events, c, long_events, long_plain = asyncio.run(run())

    assert b.status_code == 503, b.text
    assert "retry-after" in b.headers
    err = helpers.assert_error_envelope(b.json())
    assert err["code"] == "queue_full" and "prompt tokens" in err["message"], err

    assert d.status_code == 503, d.text  # not the 400 its out-of-vocabulary prompt would get
    assert helpers.assert_error_envelope(d.json())["code"] == "queue_full"

    assert c.status_code == 503, c.text
    assert "retry-after" in c.headers
    assert helpers.assert_error_envelope(c.json())["code"] == "queue_timeout"

    assert a_events[-1] == "[DONE]" and len(a_events) == 2, a_events  # nothing generated, then the error
    assert helpers.assert_error_envelope(a_events[0])["code"] == "queue_timeout"

    assert long_plain.status_code == 504, long_plain.text
    assert helpers.assert_error_envelope(long_plain.json())["code"] == "request_timeout"
    assert long_events[-1] == "[DONE]", long_events[-3:]
    assert helpers.assert_error_envelope(long_events[-2])["code"] == "request_timeout"
    assert any(c["text"] for e in long_events[:-2] for c in e["choices"]), "it streamed tokens before its deadline"

    # every one of the four ended in the engine as an abort, and its blocks were freed
    idle = asyncio.run(_wait_metrics(helpers, url, lambda m: m[RUNNING] == m[WAITING] == m[KV_USAGE] == 0))
    assert idle[RUNNING] == idle[WAITING] == idle[KV_USAGE] == 0, idle
    assert _aborted(url) - aborted_before == 4
    # and the server serves again within its limits
    ok = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_more_samples_than_the_queue_holds_is_a_400_not_a_503(tight, helpers):
    """A request that could never fit must not be told to retry later."""
    url, model = tight
    body = {"model": model, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}  # 6 samples > 4 places
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert helpers.assert_error_envelope(r.json())["param"] == "n"
    ok = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ["a", "b"]}, timeout=60)  # 4 fit
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("flag,value", [
    ("--max-queue-time", "0"), ("--request-timeout", "-1"), ("--request-timeout", "nan"),
    ("--shutdown-timeout", "-1"), ("--max-waiting-tokens", "0"),
])
def test_bad_limits_stop_the_start(flag, value, capsys):
    """Refused before the model loads: exit status 2 and the setting named."""
    assert main(["serve", flag, value]) == 2
    assert flag.lstrip("-").replace("-", "_") in capsys.readouterr().err

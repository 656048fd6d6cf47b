"""Named API keys against the real server (`--api-keys-file`): 401 for unknown keys, each
limit's 429 with OpenAI's headers and a Retry-After the OpenAI SDK waits for before its
retry succeeds, per-key metrics without key material, and SIGHUP reloads (a removed key's
stream finishes; a malformed file keeps the keys in force).

One server process on the tiny random model (the outputs do not matter here), with small
limits so that every refusal comes within a second or two.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from processes import Server, pagoda_command

HASHED_KEY = "hashed-key"
KEYS = {
    "keys": [
        {"name": "open", "key": "open-key"},
        {"name": "rpm", "key": "rpm-key", "requests_per_minute": 30},
        {"name": "tpm", "key": "tpm-key", "tokens_per_minute": 240},
        {"name": "conc", "key": "conc-key", "max_concurrent_requests": 1},
        {"name": "gone", "key": "gone-key"},
        {"name": "hashed", "key_sha256": hashlib.sha256(HASHED_KEY.encode()).hexdigest(), "priority": 2},
    ]
}
PLAIN_KEYS = ["open-key", "rpm-key", "tpm-key", "conc-key", "gone-key", HASHED_KEY]


def _write_keys(path, keys) -> None:
    # YAML reads JSON: the file is checked as YAML (its suffix is .yaml).
    path.write_text(json.dumps(keys))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys.yaml"
    _write_keys(path, KEYS)
    return path


@pytest.fixture(scope="module")
def keyed_server(tiny_model_path, keys_file, tmp_path_factory):
    server = Server("pagoda-keys", pagoda_command(
        "--model", str(tiny_model_path), "--max-model-len", "512", "--api-keys-file", str(keys_file),
        "--max-num-seqs", "8", "--kv-cache-memory", "0.05"), tmp_path_factory.mktemp("keys-logs"))
    server.wait_ready(120)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def url(keyed_server):
    return keyed_server.url


@pytest.fixture(scope="module")
def model(url):
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer open-key"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["id"]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(url, model, key, **body):
    body = {"model": model, "prompt": "Hello there", "max_tokens": 1, **body}
    return httpx.post(f"{url}/v1/completions", headers=_auth(key), json=body, timeout=60)


def _sdk(url, key, max_retries) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=max_retries, timeout=60)


def _assert_429(r, error_type: str, helpers) -> float:
    """A rate-limit refusal as OpenAI answers one; returns its precise wait in seconds."""
    assert r.status_code == 429, r.text
    err = helpers.assert_error_envelope(r.json())
    assert err["code"] == "rate_limit_exceeded" and err["type"] == error_type, err
    assert int(r.headers["retry-after"]) >= 1
    wait_s = int(r.headers["retry-after-ms"]) / 1000
    assert 0 < wait_s <= int(r.headers["retry-after"]), r.headers
    return wait_s


def test_unknown_or_missing_key_is_401_without_rate_limit_headers(url, model, helpers):
    for headers in ({}, _auth("nope"), _auth("open-ke"), {"Authorization": "Basic open-key"}):
        r = httpx.post(f"{url}/v1/completions", headers=headers, json={"model": model, "prompt": "x"}, timeout=30)
        assert r.status_code == 401, r.text
        assert helpers.assert_error_envelope(r.json())["code"] == "invalid_api_key"
        assert not any(h.startswith("x-ratelimit") for h in r.headers)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # probes stay open


def test_hashed_key_and_the_priority_it_allows(url, model, helpers):
    assert _complete(url, model, HASHED_KEY).status_code == 200
    assert _complete(url, model, HASHED_KEY, priority=3).status_code == 200
    r = _complete(url, model, HASHED_KEY, priority=1)  # more urgent than the key's priority 2
    assert r.status_code == 400, r.text
    assert helpers.assert_error_envelope(r.json())["param"] == "priority"
    # a key without a priority has priority 0: less urgent requests pass, more urgent ones do not
    assert _complete(url, model, "open-key", priority=5).status_code == 200
    assert _complete(url, model, "open-key", priority=-5).status_code == 400
    chat = httpx.post(f"{url}/v1/chat/completions", headers=_auth("open-key"), timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "priority": 1})
    assert chat.status_code == 200, chat.text
    # the Responses API takes the same field, within the same bounds
    responses = [httpx.post(f"{url}/v1/responses", headers=_auth(HASHED_KEY), timeout=60, json={
        "model": model, "input": "hi", "max_output_tokens": 1, "priority": p}) for p in (3, 1)]
    assert responses[0].status_code == 200, responses[0].text
    assert responses[1].status_code == 400 and helpers.assert_error_envelope(responses[1].json())["param"] == "priority"


def test_requests_per_minute_429_then_the_sdk_retry_succeeds(url, model, helpers):
    # 30 a minute: a burst of 30, then one more every 2 s; requests come faster than that.
    num_ok = 0
    for i in range(90):
        r = _complete(url, model, "rpm-key")
        assert r.headers["x-ratelimit-limit-requests"] == "30"
        if i == 0:
            assert int(r.headers["x-ratelimit-remaining-requests"]) == 29
            assert r.headers["x-ratelimit-reset-requests"].endswith("s")
            assert "x-ratelimit-limit-tokens" not in r.headers  # this key has no token limit
        if r.status_code != 200:
            break
        num_ok += 1
    assert num_ok >= 30, "the burst is the whole minute's allowance"
    wait_s = _assert_429(r, "requests", helpers)
    assert wait_s <= 2.0
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    t0 = time.monotonic()
    out = _sdk(url, "rpm-key", max_retries=2).completions.create(model=model, prompt="Hi", max_tokens=1)
    assert out.usage.completion_tokens == 1
    assert time.monotonic() - t0 >= 0.5 * wait_s  # it waited for Retry-After


def test_tokens_per_minute_429_then_the_sdk_retry_succeeds(url, model, helpers):
    # 240 tokens a minute (4 a second). Prompts as token ids, so their sizes are exact: 200 + 1
    # generated leave ~39, and a 50-token prompt must then wait ~3 s.
    r = _complete(url, model, "tpm-key", prompt=[1000] * 200)
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-limit-tokens"] == "240"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 40
    r = _complete(url, model, "tpm-key", prompt=[1000] * 50)
    wait_s = _assert_429(r, "tokens", helpers)
    assert wait_s <= 3.0
    t0 = time.monotonic()
    out = _sdk(url, "tpm-key", max_retries=3).completions.create(model=model, prompt=[1000] * 50, max_tokens=1)
    assert out.usage.prompt_tokens == 50
    assert time.monotonic() - t0 >= 0.5 * wait_s  # it waited for Retry-After
    # Completion tokens are counted as produced, into debt, but never cut a request short.
    out = _sdk(url, "tpm-key", max_retries=3).completions.create(
        model=model, prompt=[1000], max_tokens=100, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 100
    r = _complete(url, model, "tpm-key", prompt=[1000])
    _assert_429(r, "tokens", helpers)


def test_max_concurrent_requests_429_then_the_sdk_retry_succeeds(url, model, helpers):
    body = {"model": model, "prompt": "Count:", "max_tokens": 40, "ignore_eos": True, "stream": True}
    first_chunk = threading.Event()
    done = {}

    def stream():
        with httpx.stream("POST", f"{url}/v1/completions", headers=_auth("conc-key"), json=body, timeout=60) as r:
            done["status"] = r.status_code
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                first_chunk.set()
            done["lines"] = lines
        first_chunk.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_chunk.wait(30)
    r = _complete(url, model, "conc-key")
    if done.get("lines") is None:  # the stream still holds the key's one slot
        _assert_429(r, "requests", helpers)
    t0 = time.monotonic()
    out = _sdk(url, "conc-key", max_retries=10).completions.create(model=model, prompt="Hi", max_tokens=1)
    assert out.usage.completion_tokens == 1
    print(f"concurrency: the SDK's request went through after {time.monotonic() - t0:.1f} s")
    thread.join(60)
    assert done["status"] == 200 and [line for line in done["lines"] if line][-1] == "data: [DONE]"


def test_limits_and_the_queue_count_samples_and_one_key_cannot_fill_the_queue(url, model, helpers):
    """A request's samples (prompts x n) count against its key's max_concurrent_requests and
    against the queue, where one key may hold at most three quarters of --max-waiting-requests
    (1,024 here): while one key's 768 samples are queued, another key's request still runs."""
    r = _complete(url, model, "conc-key", n=2)  # max_concurrent_requests 1: two samples never fit
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = _complete(url, model, "open-key", prompt=["Count:"] * 64, n=16)  # 1,024 samples: past one key's share
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    # Long enough to stay unfinished while the rest of the test runs; the client gives up
    # after a few seconds, which aborts what is left of it.
    body = {"model": model, "prompt": ["Count:"] * 48, "n": 16, "max_tokens": 400, "ignore_eos": True}
    big = threading.Thread(target=_post_and_give_up, args=(url, body, "open-key", 6.0))
    big.start()
    try:
        deadline = time.monotonic() + 30
        while _queued(helpers, url) < 700:  # most of its 768 samples are in the engine
            assert time.monotonic() < deadline and big.is_alive(), _queued(helpers, url)
            time.sleep(0.1)
        t0 = time.monotonic()
        other = _complete(url, model, "gone-key")
        latency = time.monotonic() - t0
        assert other.status_code == 200, other.text  # before: 503 queue_full
        more = _complete(url, model, "open-key")
        assert more.status_code == 429 and "share of the queue" in more.json()["error"]["message"], more.text
    finally:
        big.join(60)
    print(f"another key's request while 768 samples were queued: {latency:.2f} s")
    assert latency < 15, latency  # the fair scheduler runs it before the queued samples
    assert helpers.idle(helpers.wait_idle(url)), "KV blocks still in use after the big request was given up"


def _queued(helpers, url) -> float:
    metrics = helpers.scrape_metrics(url)
    return metrics.get("pagoda:num_requests_running", 0) + metrics.get("pagoda:num_requests_waiting", 0)


def _post_and_give_up(url, body, key, after_s) -> None:
    try:
        httpx.post(f"{url}/v1/completions", headers=_auth(key), json=body,
                   timeout=httpx.Timeout(after_s, connect=10))
    except httpx.TimeoutException:
        pass


def test_per_key_metrics_carry_names_never_keys(url, model, helpers):
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for key in PLAIN_KEYS:
        assert key not in text
        assert hashlib.sha256(key.encode()).hexdigest()[:16] not in text
    metrics = helpers.scrape_metrics(url)
    assert metrics["pagoda:api_keys"] == len(KEYS["keys"])
    assert metrics["pagoda:tenant_requests_total"] >= 30
    assert metrics["pagoda:tenant_rejections_total"] >= 2
    assert metrics["pagoda:tenant_generation_tokens_total"] >= 100
    assert metrics["pagoda:tenant_time_to_first_token_seconds_count"] >= 30
    assert 'tenant="rpm"' in text and 'limit="requests"' in text and 'limit="tokens"' in text


def test_bad_input_and_aborted_streams_with_keys_on_get_4xx_and_leak_nothing(url, model, helpers):
    """Keys on change nothing about bad input (a clear 4xx, never a 500) or aborts (every
    KV block back); the key's concurrency count is released by both."""
    bad = [
        ("/v1/completions", b'{"model": "m", "prompt": '),  # truncated JSON
        ("/v1/completions", {"model": model, "prompt": 5}),
        ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": -1}),
        ("/v1/completions", {"model": model, "prompt": "x", "temperature": "hot"}),
        ("/v1/completions", {"model": model, "prompt": "x " * 2000}),  # past --max-model-len 512
        ("/v1/completions", {"model": model, "prompt": "x", "priority": 10**6}),
        ("/v1/chat/completions", {"model": model, "messages": []}),
        ("/v1/responses", {"model": model, "input": 7}),
    ]
    for path, body in bad:
        for key in ("open-key", "conc-key"):
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = httpx.post(f"{url}{path}", headers=_auth(key), timeout=60, **kw)
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
            helpers.assert_error_envelope(r.json())
    body = {"model": model, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", f"{url}/v1/completions", headers=_auth("open-key"), json=body, timeout=60) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data:"))  # then the client goes away
    assert helpers.idle(helpers.wait_idle(url)), "KV blocks still in use after the aborted streams"
    # conc-key's one slot was given back by its refused requests
    assert _complete(url, model, "conc-key").status_code == 200


def test_sighup_reload_adds_and_removes_keys_while_a_removed_keys_stream_finishes(
    keyed_server, keys_file, url, model, helpers
):
    body = {"model": model, "prompt": "Count:", "max_tokens": 120, "ignore_eos": True, "stream": True}
    new_keys = {"keys": [k for k in KEYS["keys"] if k["name"] != "gone"] + [{"name": "new", "key": "new-key"}]}
    assert _complete(url, model, "new-key").status_code == 401
    with httpx.stream("POST", f"{url}/v1/completions", headers=_auth("gone-key"), json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        _write_keys(keys_file, new_keys)
        os.kill(keyed_server.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 15
        while _complete(url, model, "new-key").status_code != 200:
            assert time.monotonic() < deadline, keyed_server.log_tail()
            time.sleep(0.1)
        assert _complete(url, model, "gone-key").status_code == 401
        rest = [first, *lines]
    events = helpers.parse_sse(rest)
    assert events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    assert sum(len(e["choices"]) and 1 for e in events[:-1] if e["choices"] and e["choices"][0]["text"]) > 0
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert "added: new; removed: gone" in keyed_server.log_tail()


def test_sighup_reload_of_a_large_file_does_not_hold_up_the_server(keyed_server, keys_file, url, model):
    """6,000 keys took seconds to parse on the event loop: /health keeps answering meanwhile."""
    extra = [{"name": f"bulk-{i}", "key": f"bulk-key-{i}", "requests_per_minute": 1000} for i in range(6000)]
    new_keys = {"keys": [k for k in KEYS["keys"] if k["name"] != "gone"] + [{"name": "new", "key": "new-key"}] + extra}
    _write_keys(keys_file, new_keys)
    os.kill(keyed_server.proc.pid, signal.SIGHUP)
    slowest = 0.0
    deadline = time.monotonic() + 90
    with httpx.Client(timeout=60) as http:
        while http.post(f"{url}/tokenize", headers=_auth("bulk-key-5999"),
                        json={"model": model, "prompt": "hi"}).status_code != 200:
            assert time.monotonic() < deadline, keyed_server.log_tail()
            t0 = time.monotonic()
            assert http.get(f"{url}/health").status_code == 200
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.05)
    print(f"slowest /health during the reload: {slowest:.3f} s")
    assert slowest < 1.5, f"/health took {slowest:.1f} s during the reload"
    assert _complete(url, model, "new-key").status_code == 200
    # back to the small file (each request is checked against every key in force)
    _write_keys(keys_file, {"keys": new_keys["keys"][:-len(extra)]})
    os.kill(keyed_server.proc.pid, signal.SIGHUP)
    while _complete(url, model, "bulk-key-0").status_code != 401:
        assert time.monotonic() < deadline, keyed_server.log_tail()
        time.sleep(0.1)


def test_malformed_reload_keeps_the_keys_in_force(keyed_server, keys_file, url, model, helpers):
    keys_file.write_text("keys:\n  - name: broken\n    key: [not, a, string]\n")
    os.kill(keyed_server.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 15
    while "API keys file not reloaded" not in keyed_server.log_tail():
        assert time.monotonic() < deadline, keyed_server.log_tail()
        time.sleep(0.1)
    log = keyed_server.log_tail()
    assert "keys[0] (broken)" in log and "'key' must be" in log
    assert _complete(url, model, "open-key").status_code == 200
    assert _complete(url, model, "new-key").status_code == 200
    assert _complete(url, model, "broken").status_code == 401
    # and nothing leaked: every KV block is back once the server is idle
    assert helpers.idle(helpers.wait_idle(url)), "KV blocks still in use after every request ended"
    for key in PLAIN_KEYS:
        assert key not in log


def test_malformed_keys_file_at_start_up_is_a_clear_error(tmp_path, capsys):
    from server.cli import main

    bad = tmp_path / "keys.yaml"
    bad.write_text('keys:\n  - name: a\n    key: "k"\n    requests_per_minute: -3\n')
    assert main(["serve", "--api-keys-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "keys[0] (a): 'requests_per_minute' must be a positive integer" in err
    assert main(["serve", "--api-keys-file", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read the keys file" in capsys.readouterr().err

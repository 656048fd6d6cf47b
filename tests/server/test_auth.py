"""A server started with `--api-key secret`: 401 without the key, open probes stay open.

The same process also runs with `--max-waiting-requests 4`, so the queue-full 503 is
tested here without paying for a third server.
"""

import asyncio
import json

import httpx
import openai
import pytest

KEY = "secret"
MAX_WAITING = 4


@pytest.fixture(scope="module")
def auth_server(start_server):
    server = start_server(["--api-key", KEY, "--max-waiting-requests", str(MAX_WAITING)])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auth_url(auth_server):
    return auth_server.url


@pytest.fixture(scope="module")
def auth_model(auth_url):
    r = httpx.get(f"{auth_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["id"]


COMPLETION = {"model": "__MODEL__", "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": "__MODEL__", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (id, method, path, json body, Authorization header or None, expected status)
AUTH_CASES = [
    ("completions_no_key", "POST", "/v1/completions", COMPLETION, None, 401),
    ("completions_wrong_key", "POST", "/v1/completions", COMPLETION, "Bearer wrong", 401),
    ("completions_key_prefix", "POST", "/v1/completions", COMPLETION, "Bearer secre", 401),
    ("completions_key_longer", "POST", "/v1/completions", COMPLETION, "Bearer secretX", 401),
    ("completions_key_without_bearer", "POST", "/v1/completions", COMPLETION, KEY, 401),
    ("completions_basic_scheme", "POST", "/v1/completions", COMPLETION, f"Basic {KEY}", 401),
    ("completions_bare_bearer", "POST", "/v1/completions", COMPLETION, "Bearer", 401),
    ("chat_no_key", "POST", "/v1/chat/completions", CHAT, None, 401),
    ("chat_wrong_key", "POST", "/v1/chat/completions", CHAT, "Bearer wrong", 401),
    ("models_no_key", "GET", "/v1/models", None, None, 401),
    ("tokenize_no_key", "POST", "/tokenize", {"model": "__MODEL__", "prompt": "hi"}, None, 401),
    ("detokenize_no_key", "POST", "/detokenize", {"model": "__MODEL__", "tokens": [1, 2]}, None, 401),
    # checked before the body is even parsed: no key + broken JSON is still a 401
    ("bad_json_no_key", "POST", "/v1/completions", "{not json", None, 401),
    ("health_no_key", "GET", "/health", None, None, 200),
    ("metrics_no_key", "GET", "/metrics", None, None, 200),
    ("version_no_key", "GET", "/version", None, None, 200),
    ("health_wrong_key", "GET", "/health", None, "Bearer wrong", 200),
    ("completions_right_key", "POST", "/v1/completions", COMPLETION, f"Bearer {KEY}", 200),
    ("models_right_key", "GET", "/v1/models", None, f"Bearer {KEY}", 200),
    ("tokenize_right_key", "POST", "/tokenize", {"model": "__MODEL__", "prompt": "hi"}, f"Bearer {KEY}", 200),
]


@pytest.mark.parametrize("method,path,body,authorization,status", [c[1:] for c in AUTH_CASES],
                         ids=[c[0] for c in AUTH_CASES])
def test_api_key(auth_url, auth_model, helpers, method, path, body, authorization, status):
    headers = {"Authorization": authorization} if authorization is not None else {}
    kwargs = {}
    if isinstance(body, dict):
        kwargs["json"] = {k: (auth_model if v == "__MODEL__" else v) for k, v in body.items()}
    elif isinstance(body, str):
        kwargs["content"] = body.encode()
        headers["Content-Type"] = "application/json"
    r = httpx.request(method, f"{auth_url}{path}", headers=headers, timeout=60, **kwargs)
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text[:300]}"
    if status == 401:
        err = helpers.assert_error_envelope(r.json())
        assert KEY not in r.text, "the 401 leaks the key"
        assert err["param"] is None


@pytest.mark.parametrize("path, headers, status", [
    ("/v1/completions", {"X-Api-Key": KEY}, 200),
    ("/completions", {"x-api-key": KEY}, 200),
    ("/invocations", {"X-Api-Key": KEY}, 200),
    ("/v1/completions", {"X-Api-Key": "wrong"}, 401),
    ("/v1/completions", {"X-Api-Key": ""}, 401),
    # A Bearer key is the one checked when both come.
    ("/v1/completions", {"Authorization": "Bearer wrong", "X-Api-Key": KEY}, 401),
    ("/v1/completions", {"Authorization": f"Bearer {KEY}", "X-Api-Key": "wrong"}, 200),
    ("/completions", {}, 401),
    ("/chat/completions", {}, 401),
    ("/invocations", {}, 401),
], ids=["x_api_key", "x_api_key_lowercase", "x_api_key_invocations", "x_api_key_wrong", "x_api_key_empty",
        "bearer_wrong_x_api_key_right", "bearer_right_x_api_key_wrong", "alias_no_key", "chat_alias_no_key",
        "invocations_no_key"])
def test_x_api_key_and_the_other_routes(auth_url, auth_model, helpers, path, headers, status):
    body = {**COMPLETION, "model": auth_model} if path != "/chat/completions" else {**CHAT, "model": auth_model}
    r = httpx.post(f"{auth_url}{path}", json=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text[:300]
    if status == 401:
        assert helpers.assert_error_envelope(r.json())["param"] is None


def test_ping_is_open(auth_url):
    assert httpx.get(f"{auth_url}/ping", timeout=10).status_code == 200


def test_openai_client_with_and_without_the_key(auth_url, auth_model):
    wrong = openai.OpenAI(base_url=f"{auth_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=auth_model, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=auth_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                      stream=True)
    right = openai.OpenAI(base_url=f"{auth_url}/v1", api_key=KEY, max_retries=0)
    out = right.completions.create(model=auth_model, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens >= 1
    assert [m.id for m in right.models.list().data] == [auth_model]


def test_queue_full_gets_503_with_retry_after(auth_url, auth_model, helpers):
    """More concurrent requests than --max-waiting-requests: the excess gets 503 + Retry-After.

    Half stream: a full queue must be reported as an HTTP status, not as an error event
    inside a 200 stream.
    """
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": auth_model, "prompt": "Count to one hundred:", "max_tokens": 48, "ignore_eos": True}

    async def one(http, stream):
        if not stream:
            r = await http.post("/v1/completions", json=body)
            return stream, r.status_code, r.headers, r.content
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            return stream, r.status_code, r.headers, await r.aread()

    async def burst():
        async with httpx.AsyncClient(base_url=auth_url, headers=headers, timeout=120) as http:
            return await asyncio.gather(*(one(http, stream=i % 2 == 1) for i in range(3 * MAX_WAITING)))

    results = asyncio.run(burst())
    statuses = [status for _, status, _, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 1, statuses
    assert statuses.count(200) >= 1, statuses
    for stream, status, resp_headers, content in results:
        if status == 503:
            assert "retry-after" in resp_headers, resp_headers
            assert int(resp_headers["retry-after"]) >= 0
            helpers.assert_error_envelope(json.loads(content))
        elif stream:
            events = helpers.parse_sse(content.decode().splitlines())
            assert events and events[-1] == "[DONE]", content[-2000:]
            assert not any(isinstance(e, dict) and "error" in e for e in events), content[-2000:]
        else:
            assert json.loads(content)["usage"]["completion_tokens"] == body["max_tokens"], content
    # and the server takes requests again once the burst is over
    r = httpx.post(f"{auth_url}/v1/completions", headers=headers, json={**body, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_anthropic_sdk_keys_and_overload(auth_url, auth_model):
    """/v1/messages: the Anthropic SDK's x-api-key and Bearer token both work; a bad key and a
    full queue come back in Anthropic's envelope, the full queue as its 529 overloaded_error."""
    import anthropic

    messages = [{"role": "user", "content": "Hi"}]
    for client in (anthropic.Anthropic(base_url=auth_url, api_key=KEY, max_retries=0),  # x-api-key
                   anthropic.Anthropic(base_url=auth_url, auth_token=KEY, max_retries=0)):  # Authorization: Bearer
        assert client.messages.create(model=auth_model, max_tokens=2, messages=messages).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=auth_url, api_key="wrong", max_retries=0).messages.create(
            model=auth_model, max_tokens=2, messages=messages)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "incorrect API key provided"}}
    body = {"model": auth_model, "max_tokens": 12, "messages": [{"role": "user", "content": "Count to one hundred:"}]}

    async def burst():
        async with httpx.AsyncClient(base_url=auth_url, headers={"x-api-key": KEY}, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/messages", json=body) for _ in range(3 * MAX_WAITING)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 529}, statuses
    for r in responses:
        if r.status_code == 529:
            assert "retry-after" in r.headers, r.headers
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error", r.text

"""Security regressions: no way around --api-key, no prompt text in /metrics, and no
prefix-cache sharing between different `cache_salt` values.

The odd paths go out over a raw socket, byte for byte: an HTTP client would normalize
`/v1/./completions` or `//v1/completions` before sending them.
"""

import socket
import uuid

import httpx
import pytest

KEY = "s3cret-key"
PROMPT_TOKENS = "pagoda:prompt_tokens_total"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def keyed_server(start_server):
    server = start_server(["--api-key", KEY])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed(keyed_server):
    r = httpx.get(f"{keyed_server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    return keyed_server, r.json()["data"][0]["id"]


def raw_request(
    port: int, method: str, target: str, body: bytes = b"", headers: dict | None = None
) -> tuple[int, bytes]:
    """Send one HTTP/1.1 request exactly as given; return (status, raw response)."""
    headers = {"Host": f"127.0.0.1:{port}", "Connection": "close", "Content-Type": "application/json",
               "Content-Length": str(len(body)), **(headers or {})}
    lines = [f"{method} {target} HTTP/1.1"] + [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + body)
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
    status_line = response.split(b"\r\n", 1)[0]
    return int(status_line.split()[1]), response


ODD_PATHS = [
    "//v1/completions",
    "/v1//completions",
    "/v1/./completions",
    "/./v1/completions",
    "/v1/completions/",
    "/v1/completions/.",
    "/V1/completions",
    "/v1/Completions",
    "/v1%2Fcompletions",
    "/%2Fv1%2Fcompletions",
    "/v1/completions%2F",
    "/v1/completions%00",
    "/v1/completions;x=1",
    "/v1/completions?x",
    "/v1/completions?api_key=" + KEY,
    "/health/../v1/completions",
    "/health%2F..%2Fv1%2Fcompletions",
    "/metrics/../v1/completions",
    "/version/..%2Fv1/completions",
    "/v1/chat/../completions",
    "http://127.0.0.1/v1/completions",
    "/openapi.json",
    "/docs",
]
FORWARDING_HEADERS = [
    {"Host": "localhost"},
    {"X-Forwarded-For": "127.0.0.1"},
    {"X-Real-IP": "127.0.0.1"},
    {"X-Forwarded-Host": "localhost", "X-Forwarded-Proto": "https"},
    {"X-Forwarded-Prefix": "/health"},
    {"X-Original-URL": "/health"},
    {"X-Rewrite-URL": "/health"},
    {"X-Forwarded-Path": "/health"},
]


def _completion(model: str, prompt: str) -> bytes:
    return f'{{"model": "{model}", "prompt": "{prompt}", "max_tokens": 2}}'.encode()


@pytest.mark.parametrize("path", ODD_PATHS)
@pytest.mark.parametrize("method", ["POST", "GET", "HEAD", "OPTIONS", "PUT"])
def test_odd_paths_and_methods_need_the_key(keyed, method, path):
    server, model = keyed
    status, response = raw_request(server.port, method, path, _completion(model, "bypass"))
    assert status == 401, response[:400]


@pytest.mark.parametrize("headers", FORWARDING_HEADERS, ids=lambda h: "+".join(h))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"])
def test_host_and_forwarding_headers_do_not_open_routes(keyed, path, headers):
    server, model = keyed
    status, response = raw_request(server.port, "POST" if path != "/v1/models" else "GET", path,
                                   _completion(model, "bypass"), headers)
    assert status == 401, response[:400]


def test_no_bypass_reached_the_engine(keyed, helpers):
    """Runs after the tables above (file order): none of them prefilled a single token."""
    server, model = keyed
    before = helpers.scrape_metrics(server.url)[PROMPT_TOKENS]
    assert before == 0, "a request without the key reached the engine"
    # the keyed request itself works and moves the counter: the check above can fail
    status, response = raw_request(server.port, "POST", "/v1/completions", _completion(model, "Hello"),
                                   {"Authorization": f"Bearer {KEY}"})
    assert status == 200, response[:400]
    assert helpers.scrape_metrics(server.url)[PROMPT_TOKENS] > 0


def test_metrics_carry_no_prompt_text(keyed):
    server, model = keyed
    marker = f"zq{uuid.uuid4().hex}"
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=60) as http:
        ok = [
            http.post("/v1/completions", json={"model": model, "prompt": f"{marker} says", "max_tokens": 2,
                                               "user": marker, "cache_salt": marker}),
            http.post("/v1/chat/completions", json={"model": model, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": marker}]}),
            http.post("/v1/completions", json={"model": model, "prompt": marker, "max_tokens": 2, "stream": True}),
        ]
        failed = [
            http.post("/v1/completions", json={"model": marker, "prompt": marker}),
            http.post("/v1/completions", json={"model": model, "prompt": marker, "stop": [marker] * 100}),
            http.post("/v1/completions", json={"model": model, "prompt": marker, "max_tokens": 10**6}),
        ]
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert [r.status_code for r in ok] == [200, 200, 200], [r.text[:200] for r in ok]
    assert all(r.status_code in (400, 404) for r in failed), [r.text[:200] for r in failed]
    assert "pagoda:request_success_total" in metrics
    assert marker not in metrics
    assert marker[:12] not in metrics


def _cached_tokens(http, model, prompt, salt) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


# Salts that a sloppy key (concatenation, normalization, case folding, str() of None,
# a quoting-unaware join) would confuse with each other.
SALT_PAIRS = [
    ("tenant-a", "tenant-b"),
    ("tenant", "Tenant"),
    ("tenant", "tenant "),
    ("a\u0301", "\u00e1"),  # the same letter, decomposed and precomposed
    ("x", "x\u0000"),
    ("'x'", "x"),
    ("None", None),
    ("1, 2", "1,2"),
]


@pytest.mark.parametrize("first,second", SALT_PAIRS, ids=[f"{a!r}-vs-{b!r}" for a, b in SALT_PAIRS])
def test_prefix_cache_never_crosses_salts(keyed, first, second):
    server, model = keyed
    prompt = f"Request {uuid.uuid4().hex}: " + "the caravan crossed the desert at night, guided by stars. " * 6
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        assert _cached_tokens(http, model, prompt, first) == 0
        assert _cached_tokens(http, model, prompt, second) == 0, f"{second!r} read the cache of {first!r}"
        # each salt does reuse its own cache, so the zeros above mean separation, not a cold cache
        assert _cached_tokens(http, model, prompt, first) >= BLOCK_SIZE
        assert _cached_tokens(http, model, prompt, second) >= BLOCK_SIZE

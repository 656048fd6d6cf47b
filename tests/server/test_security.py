"""Security regressions: no way around --api-key, no prompt text in /metrics, no
prefix-cache sharing between different `cache_salt` values, and bounded request heads
(size, header count, read time) before any key is checked.

The odd paths go out over a raw socket, byte for byte: an HTTP client would normalize
`/v1/./completions` or `//v1/completions` before sending them.
"""

import json
import socket
from concurrent.futures import ThreadPoolExecutor
import time
import uuid

import httpx
import pytest

KEY = "s3cret-key"
PROMPT_TOKENS = "pagoda:prompt_tokens_total"
BLOCK_SIZE = 16
READ_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def keyed_server(start_server):
    # A short read timeout, so that the silent-connection case below takes seconds.
    server = start_server(["--api-key", KEY, "--client-read-timeout", str(READ_TIMEOUT_S)])
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


# ---- what a client may send before the key is checked -------------------------------------------
def exchange(port: int, data: bytes, timeout_s: float = 30) -> bytes:
    """Send raw bytes, read until the server closes. A server that closes with unread bytes
    of ours may reset the connection after its answer: what came before the reset counts."""
    response = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data)
            while chunk := sock.recv(65536):
                response += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
    return response


def _status(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split()[1])


HEAD = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"


@pytest.mark.parametrize("extra", [
    b"X-Big: " + b"a" * 100_000 + b"\r\n",
    b"".join(b"X-%d: a\r\n" % i for i in range(1000)),
], ids=["100k_header", "1000_headers"])
def test_oversized_heads_get_431_without_a_key(keyed, extra, helpers):
    server, _ = keyed
    response = exchange(server.port, HEAD + extra + b"\r\n")
    assert _status(response) == 431, response[:400]
    helpers.assert_error_envelope(json.loads(response.split(b"\r\n\r\n", 1)[1]))
    # a head within the limits still reaches the key check
    assert _status(exchange(server.port, HEAD + b"".join(b"X-%d: a\r\n" % i for i in range(90)) + b"\r\n")) == 401


@pytest.mark.parametrize("length", [b"0" * 5000 + b"2", b"9" * 5001])
def test_content_length_of_5001_digits_is_a_400(keyed, length):
    server, model = keyed
    body = b'{"model": "' + model.encode() + b'", "prompt": "hi"}'
    status, response = raw_request(server.port, "POST", "/v1/completions", body[:2],
                                   {"Authorization": f"Bearer {KEY}", "Content-Length": length.decode()})
    assert status == 400, response[:400]


def test_connections_that_never_finish_are_closed(keyed):
    """A connection that sends nothing, half a head, or a head and half its body, is closed
    after the read timeout (the three at once, to wait the timeout once)."""
    server, _ = keyed
    half_a_body = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                   + b"\r\nContent-Length: 50\r\n\r\n{")
    started = time.monotonic()
    with ThreadPoolExecutor(3) as pool:  # a socket.timeout (never closed) fails the test
        nothing, half_head, half_body = pool.map(
            lambda sent: exchange(server.port, sent, timeout_s=READ_TIMEOUT_S + 30), [b"", HEAD, half_a_body])
    assert time.monotonic() - started < READ_TIMEOUT_S + 10
    assert nothing == b"" and half_body == b"", (nothing, half_body)
    assert _status(half_head) == 408, half_head[:400]

"""Property-based fuzz of the HTTP API, generated from the server's own /openapi.json.

For each POST route, hypothesis-jsonschema draws bodies that follow the published request
schema, and mutations of them: a field dropped, any value anywhere in the body replaced
by arbitrary JSON, any JSON value as the whole body, raw bytes. Every answer must be a success or a 4xx in
the OpenAI error envelope: never a 5xx, never FastAPI's 422, never a broken stream; and
the server must be healthy afterwards. What it found goes into test_bad_input.py's table.

Valid bodies run real generations, so the fields that set their cost (max_tokens, n)
are capped in the schema and in the mutated bodies: the fuzz explores shapes and types,
not lengths (test_soak.py and test_overload.py cover load).
"""

import collections
import copy
import json
import urllib.parse

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)
COST_CAPS = {
    "max_tokens": {"type": "integer", "minimum": 0, "maximum": 4},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 4},
    "n": {"type": "integer", "minimum": 1, "maximum": 2},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": 4},
}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def openapi(server_url):
    r = httpx.get(f"{server_url}/openapi.json", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def http(server_url):
    with httpx.Client(base_url=server_url, timeout=120) as client:
        yield client


def request_schema(openapi, path) -> dict:
    """The route's body schema, self-contained, with the cost fields capped."""
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    name = ref.rsplit("/", 1)[1]
    components = copy.deepcopy(openapi["components"]["schemas"])
    properties = components[name]["properties"]
    for field, cap in COST_CAPS.items():
        if field in properties:
            properties[field] = cap
    return {"$ref": ref, "components": {"schemas": components}}


def bodies(schema: dict, model: str) -> st.SearchStrategy:
    valid = from_schema(schema)
    # Half the schema-valid bodies name the served model, so they get past the model check.
    valid = st.tuples(valid, st.booleans()).map(lambda vb: {**vb[0], "model": model} if vb[1] else vb[0])

    def drop_a_field(body):
        if not body:
            return st.just(body)
        return st.sampled_from(sorted(body)).map(lambda k: {f: v for f, v in body.items() if f != k})

    def replace_a_value(body):
        # anywhere in the tree: a message's role, a prompt's third token id, a stop string
        paths = [path for path in _paths(body) if path]
        if not paths:
            return st.just(body)
        return st.tuples(st.sampled_from(paths), JSON_VALUES).map(lambda pv: _replaced(body, *pv))

    return st.one_of(
        valid,
        valid.flatmap(drop_a_field),
        valid.flatmap(replace_a_value),
        JSON_VALUES,
        st.binary(max_size=64),
    )


def _paths(value, prefix=()):
    """Every (key or index) path into a JSON value, the root's () first."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


def _replaced(value, path, new):
    """`value` with the item at `path` replaced by `new` (copies along the path only)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replaced(value[head], rest, new)}
    items = list(value)
    items[head] = _replaced(items[head], rest, new)
    return items


def bounded(path: str, body):
    """Keep a mutated body's generation short (a retyped max_tokens may be 10**4)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and 4 < value < 2**31:
            body[field] = 4
    if path == "/v1/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4  # chat without a limit runs to the end of the context
    return body


def check(r: httpx.Response, helpers) -> None:
    assert r.status_code < 500 and r.status_code != 422, f"{r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        assert r.headers.get("content-type", "").startswith("application/json"), r.headers
        helpers.assert_error_envelope(r.json())
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = helpers.parse_sse(r.text.splitlines())
        assert events and events[-1] == "[DONE]", r.text[-500:]
        assert not any(isinstance(e, dict) and "error" in e for e in events), r.text[-500:]
    else:
        assert isinstance(r.json(), dict), r.text[:500]


def post(http, path, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(bounded(path, body)).encode()
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


# One body per route that must run (200) and one that must be refused (400), tried before the
# random draws: the draws alone may by chance all be refused (45 of 45 for /v1/completions in
# one CI run), and the test's last assertion is about the server, not the dice.
KNOWN_BODIES = {
    "/v1/completions": ({"prompt": "Hi", "max_tokens": 2}, {"prompt": 7}),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, {"messages": "Hi"}),
    "/tokenize": ({"prompt": "Hi"}, {"prompt": {"a": 1}}),
    "/detokenize": ({"tokens": [1, 2]}, {"tokens": "Hi"}),
}


@pytest.mark.parametrize("path,max_examples", [
    ("/v1/completions", 45),
    ("/v1/chat/completions", 30),
    ("/tokenize", 30),
    ("/detokenize", 20),
])
def test_fuzz_post_routes(path, max_examples, openapi, http, model_name, helpers):
    statuses = collections.Counter()
    runs, refused = ({**body, "model": model_name} for body in KNOWN_BODIES[path])

    @settings(FUZZ, max_examples=max_examples)
    @given(body=bodies(request_schema(openapi, path), model_name))
    @example(body=runs)
    @example(body=refused)
    def fuzz(body):
        r = post(http, path, body)
        check(r, helpers)
        statuses[r.status_code] += 1

    fuzz()
    print(f"{path}: {dict(statuses)}")
    # both sides of the API were exercised: requests that ran and requests refused
    assert statuses[200] and statuses[400], statuses
    assert post(http, path, runs).status_code == 200 and post(http, path, refused).status_code == 400


def test_fuzz_model_routes(http, model_name, helpers):
    @settings(FUZZ, max_examples=25)
    @given(name=st.one_of(st.text(max_size=30), st.just(model_name)))
    def fuzz(name):
        r = http.get(f"/v1/models/{urllib.parse.quote(name, safe='')}")
        check(r, helpers)
        assert r.status_code in (200, 404), r.text

    fuzz()
    check(http.get("/v1/models"), helpers)


def test_schema_publishes_every_request_body(openapi):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert "$ref" in openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"], path
    assert "prompt" in openapi["components"]["schemas"]["CompletionRequest"]["required"]


def test_server_healthy_after_fuzz(http, model_name):
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"model": model_name, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text

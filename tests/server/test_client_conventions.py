"""What llama.cpp's and vLLM's clients send beyond the OpenAI core, through the shared
server: llama.cpp's `grammar`, `json_schema`, `response_format.schema` and `n_predict`, its
routes without /v1; vLLM's `stream_options.continuous_usage_stats`; `system_fingerprint`;
SageMaker's /ping and /invocations; unknown keys inside known objects (logged, or refused
where they could change the output)."""

from __future__ import annotations

import json
import re
import time
import uuid

import httpx
import jsonschema
import pytest

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PHONE_GBNF = 'root ::= d d d "-" d d d d\nd ::= [0-9]'
PHONE = re.compile(r"[0-9]{3}-[0-9]{4}")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _body(path: str, model_name: str, **fields) -> dict:
    start = {"prompt": "My phone number is"} if path == COMPLETIONS else {
        "messages": [{"role": "user", "content": "What is your phone number?"}]}
    return {"model": model_name, **start, "max_tokens": 40, "temperature": 0, **fields}


def _post(server_url, path, body, status=200):
    r = httpx.post(f"{server_url}{path}", json=body, timeout=120)
    assert r.status_code == status, r.text[:500]
    return r.json()


def _text(path: str, body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if path == COMPLETIONS else choice["message"]["content"]


def _stream(server_url, path, body) -> list[dict]:
    with httpx.stream("POST", f"{server_url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()[:500]
        lines = list(r.iter_lines())
    return [json.loads(line[5:]) for line in lines if line.startswith("data:") and line[5:].strip() != "[DONE]"]


# ---- llama.cpp's output constraints ----------------------------------------------------------------
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_grammar_constrains_the_output(server_url, model_name, path):
    free = _text(path, _post(server_url, path, _body(path, model_name, max_tokens=10)))
    assert not PHONE.fullmatch(free)  # what the field changes
    out = _post(server_url, path, _body(path, model_name, grammar=PHONE_GBNF))
    assert PHONE.fullmatch(_text(path, out)), _text(path, out)
    assert out["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("fields, param", [
    ({"grammar": "root ::= ("}, "grammar"),
    ({"grammar": ""}, "grammar"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}, "json_schema"),
    ({"grammar": PHONE_GBNF, "json_schema": SCHEMA}, "grammar"),
    ({"grammar": PHONE_GBNF, "response_format": {"type": "json_object"}}, "grammar"),
    ({"response_format": {"type": "text", "schema": SCHEMA}}, "response_format"),
    ({"response_format": {"type": "json_object", "frobnicate": 1}}, "response_format.frobnicate"),
    ({"n_predict": 5, "max_tokens": 6}, "n_predict"),
    ({"n_predict": -2}, "n_predict"),
], ids=["bad_gbnf", "empty_grammar", "bad_schema", "grammar_and_schema", "grammar_and_format", "schema_on_text",
        "unknown_format_key", "n_predict_vs_max_tokens", "n_predict_below_-1"])
def test_refused_with_the_field_named(server_url, model_name, helpers, path, fields, param):
    body = _body(path, model_name, **fields)
    if "n_predict" in fields and "max_tokens" not in fields:
        del body["max_tokens"]
    err = helpers.assert_error_envelope(_post(server_url, path, body, status=400))
    assert err["param"] == param, err


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("fields", [{"json_schema": SCHEMA}, {"response_format": {"type": "json_object", "schema": SCHEMA}}],
                         ids=["json_schema", "response_format_schema"])
def test_json_schema_constrains_the_output(server_url, model_name, path, fields):
    out = _post(server_url, path, _body(path, model_name, max_tokens=60, **fields))
    assert out["choices"][0]["finish_reason"] == "stop", out
    jsonschema.validate(json.loads(_text(path, out)), SCHEMA)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_n_predict_is_max_tokens(server_url, model_name, path):
    body = _body(path, model_name, n_predict=3, ignore_eos=True)
    del body["max_tokens"]
    out = _post(server_url, path, body)
    assert out["usage"]["completion_tokens"] == 3
    assert out["choices"][0]["finish_reason"] == "length"
    # The same value under both names is one limit.
    out = _post(server_url, path, {**body, "max_tokens": 3})
    assert out["usage"]["completion_tokens"] == 3


# ---- llama.cpp's paths, SageMaker's routes ------------------------------------------------------
def test_routes_without_the_v1_prefix(server_url, model_name):
    assert httpx.get(f"{server_url}/models", timeout=10).json() == httpx.get(f"{server_url}/v1/models", timeout=10).json()
    chat = _post(server_url, "/chat/completions", _body(CHAT, model_name, max_tokens=2))
    assert chat["object"] == "chat.completion"
    completion = _post(server_url, "/completions", _body(COMPLETIONS, model_name, max_tokens=2))
    assert completion["object"] == "text_completion"


def test_sagemaker_ping_and_invocations(server_url, model_name, helpers):
    assert httpx.get(f"{server_url}/ping", timeout=10).status_code == 200
    chat = _post(server_url, "/invocations", _body(CHAT, model_name, max_tokens=2))
    assert chat["object"] == "chat.completion"
    completion = _post(server_url, "/invocations", _body(COMPLETIONS, model_name, max_tokens=2))
    assert completion["object"] == "text_completion"
    # Streams go through too, with the route's own checks.
    chunks = _stream(server_url, "/invocations", _body(CHAT, model_name, max_tokens=2))
    assert chunks[0]["object"] == "chat.completion.chunk"
    err = helpers.assert_error_envelope(_post(server_url, "/invocations", {"model": model_name, "input": "x"}, 400))
    assert err["param"] == "messages"
    err = helpers.assert_error_envelope(_post(server_url, "/invocations", _body(CHAT, model_name, max_tokens=-1), 400))
    assert err["param"] == "max_tokens"


# ---- responses and streams ---------------------------------------------------------------------
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_system_fingerprint_in_every_response_and_chunk(server_url, model_name, path):
    body = _body(path, model_name, max_tokens=3)
    out = _post(server_url, path, body)
    assert "system_fingerprint" in out and out["system_fingerprint"] is None
    chunks = _stream(server_url, path, {**body, "stream_options": {"include_usage": True}})
    assert chunks and all("system_fingerprint" in c and c["system_fingerprint"] is None for c in chunks)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_continuous_usage_stats(server_url, model_name, path):
    body = _body(path, model_name, max_tokens=6, ignore_eos=True, n=2)
    chunks = _stream(server_url, path, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    prompt_tokens = last["usage"]["prompt_tokens"]
    seen: dict[int, int] = {}
    for c in choice_chunks:
        usage, [choice] = c["usage"], c["choices"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        assert usage["completion_tokens"] >= seen.get(choice["index"], 0)  # this choice's tokens so far
        seen[choice["index"]] = usage["completion_tokens"]
    assert seen == {0: 6, 1: 6}
    # As vLLM: without include_usage it adds nothing.
    chunks = _stream(server_url, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in chunks)


# ---- unknown keys inside known objects --------------------------------------------------------------
def test_nested_unknown_keys_are_logged_once(server, model_name):
    key = f"frobnicate_{uuid.uuid4().hex[:8]}"
    body = _body(CHAT, model_name, max_tokens=2, stream=True, stream_options={"include_usage": True, key: 1})
    body["messages"][0][key] = 1
    for _ in range(2):
        r = httpx.post(f"{server.url}{CHAT}", json=body, timeout=60)
        assert r.status_code == 200, r.text[:500]
    warnings = [f"ignoring unknown request field {name!r} (not an OpenAI or vLLM field)"
                for name in (f"stream_options.{key}", f"messages[].{key}")]
    deadline = time.monotonic() + 10
    while not all(w in server.log_path.read_text(errors="replace") for w in warnings) and time.monotonic() < deadline:
        time.sleep(0.1)  # stderr reaches the file on its own schedule
    log = server.log_path.read_text(errors="replace")
    assert [log.count(w) for w in warnings] == [1, 1]

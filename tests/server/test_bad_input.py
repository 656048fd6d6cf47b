"""Malformed and hostile requests: the exact status, the OpenAI error envelope, never a 500/422.

Raw httpx, so anything can be sent: broken JSON, NaN, lone surrogates, oversize bodies.
`__MODEL__` in a body is replaced by the served model name. The last test checks that
the server still answers a normal request after the whole table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import pytest

ANY = object()  # "don't check this field"
MIB = 1024 * 1024
LONG_PROMPT = "hello " * 600  # 600 tokens > --max-model-len 512


@dataclass
class Case:
    id: str
    body: Any = None  # dict/list -> JSON; str/bytes -> sent as is; callable(model) -> bytes
    status: int = 400
    param: Any = ANY  # str (the field; "messages" also matches "messages.0.role"), a tuple of choices, None, ANY
    code: Any = ANY
    method: str = "POST"
    path: str = "/v1/completions"
    chunked: bool = False  # send the body with Transfer-Encoding: chunked (no Content-Length)
    headers: dict = field(default_factory=dict)


def C(id, body, param=ANY, status=400, **kw):  # noqa: N802 - a table row reads better short
    return Case(id=id, body=body, param=param, status=status, **kw)


def comp(**fields):
    return {"model": "__MODEL__", "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields):
    body = {"model": "__MODEL__", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    body.update(fields)
    return body


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def raw(text: str) -> bytes:
    return text.encode()


def oversize(model: str) -> bytes:
    return json.dumps({"model": model, "prompt": "a" * (3 * MIB), "max_tokens": 1}).encode()


def deeply_nested(model: str) -> bytes:
    return b'{"model": "' + model.encode() + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


CASES = [
    # ---- not JSON / not an object -------------------------------------------------------
    C("bad_json_truncated", raw('{"model": "__MODEL__", "prompt": '), param=None),
    C("bad_json_trailing_comma", raw('{"model": "__MODEL__", "prompt": "hi",}'), param=None),
    C("empty_body", b"", param=None),
    C("body_is_a_list", [1, 2, 3], param=None),
    C("body_is_null", b"null", param=None),
    C("body_is_a_string", b'"hello"', param=None),
    C("invalid_utf8_bytes", b'{"model": "__MODEL__", "prompt": "\xff\xfe\xfd"}', param=(None, "prompt")),
    C("deeply_nested_json", deeply_nested, param=(None, "prompt")),
    # ---- NaN / Infinity (Python's json accepts them; NaN passes every `<` check) ----------
    C("nan_temperature", raw('{"model": "__MODEL__", "prompt": "hi", "max_tokens": 4, "temperature": NaN}'),
      param=("temperature", None)),
    C("infinity_top_p", raw('{"model": "__MODEL__", "prompt": "hi", "max_tokens": 4, "top_p": Infinity}'),
      param=("top_p", None)),
    C("minus_infinity_presence_penalty",
      raw('{"model": "__MODEL__", "prompt": "hi", "max_tokens": 4, "presence_penalty": -Infinity}'),
      param=("presence_penalty", None)),
    C("overflowing_float_temperature", raw('{"model": "__MODEL__", "prompt": "hi", "max_tokens": 4, "temperature": 1e999}'),
      param=("temperature", None)),
    C("nan_logit_bias_value", raw('{"model": "__MODEL__", "prompt": "hi", "max_tokens": 4, "logit_bias": {"1": NaN}}'),
      param=("logit_bias", None)),
    # ---- completions: missing fields, wrong types ----------------------------------------
    C("missing_prompt", {"model": "__MODEL__", "max_tokens": 4}, param="prompt"),
    C("prompt_is_a_number", comp(prompt=123), param="prompt"),
    C("prompt_is_an_object", comp(prompt={"text": "hi"}), param="prompt"),
    C("prompt_mixed_list", comp(prompt=[1, "a"]), param="prompt"),
    C("prompt_empty_string", comp(prompt=""), param="prompt"),
    C("prompt_empty_token_list", comp(prompt=[]), param="prompt"),
    C("prompt_token_out_of_vocab", comp(prompt=[999_999]), param="prompt"),
    C("prompt_negative_token", comp(prompt=[-1, 5]), param="prompt"),
    C("model_is_a_number", comp(model=123), param="model"),
    C("max_tokens_is_a_string", comp(max_tokens="ten"), param="max_tokens"),
    C("max_tokens_is_a_float", comp(max_tokens=1.5), param="max_tokens"),
    C("temperature_is_a_string", comp(temperature="hot"), param="temperature"),
    C("stream_is_a_string", comp(stream="yes please"), param="stream"),
    C("n_is_a_float", comp(n=1.5), param="n"),
    C("seed_is_a_string", comp(seed="abc"), param="seed"),
    C("echo_is_a_list", comp(echo=[1]), param="echo"),
    # ---- out-of-range values -------------------------------------------------------------
    C("temperature_negative", comp(temperature=-1), param="temperature"),
    C("top_p_zero", comp(top_p=0), param="top_p"),
    C("top_p_two", comp(top_p=2), param="top_p"),
    C("top_k_negative", comp(top_k=-5), param="top_k"),
    C("min_p_above_one", comp(min_p=1.5), param="min_p"),
    C("presence_penalty_five", comp(presence_penalty=5), param="presence_penalty"),
    C("frequency_penalty_minus_five", comp(frequency_penalty=-5), param="frequency_penalty"),
    C("repetition_penalty_zero", comp(repetition_penalty=0), param="repetition_penalty"),
    C("n_zero", comp(n=0), param="n"),
    C("n_1000", comp(n=1000), param="n"),
    C("max_tokens_negative", comp(max_tokens=-1), param="max_tokens"),
    # prompt + max_tokens cannot fit in 512 positions
    C("max_tokens_1e9", comp(max_tokens=10**9), param=("max_tokens", "prompt", None), code="context_length_exceeded"),
    C("max_tokens_beyond_int64", comp(max_tokens=10**30), param="max_tokens"),
    C("min_tokens_above_max_tokens", comp(min_tokens=10, max_tokens=4), param="min_tokens"),
    C("logprobs_21", comp(logprobs=21), param="logprobs"),
    C("logprobs_negative", comp(logprobs=-1), param="logprobs"),
    C("seed_beyond_int64", comp(seed=2**70), param="seed"),
    C("stream_options_without_stream", comp(stream_options={"include_usage": True}), param="stream_options"),
    # ---- stop / logit_bias fan-out --------------------------------------------------------
    C("stop_1000_entries", comp(stop=[f"stop{i}" for i in range(1000)]), param="stop"),
    C("stop_string_100k_chars", comp(stop=["x" * 100_000]), param="stop"),
    C("stop_empty_string", comp(stop=[""]), param="stop"),
    C("stop_is_a_number", comp(stop=5), param="stop"),
    C("stop_list_of_numbers", comp(stop=[1, 2]), param="stop"),
    C("stop_token_ids_out_of_vocab", comp(stop_token_ids=[10**6]), param="stop_token_ids"),
    C("logit_bias_10000_entries", comp(logit_bias={str(i): 1.0 for i in range(10_000)}), param="logit_bias"),
    C("logit_bias_non_integer_key", comp(logit_bias={"abc": 1.0}), param="logit_bias"),
    C("logit_bias_key_out_of_vocab", comp(logit_bias={"999999": 1.0}), param="logit_bias"),
    C("logit_bias_value_is_a_string", comp(logit_bias={"1": "high"}), param="logit_bias"),
    # str.isdigit() takes these, int() refuses the first two and reads the others as 3 and 12
    C("logit_bias_key_superscript_two", comp(logit_bias={"²": 1.0}), param="logit_bias"),
    C("logit_bias_key_5000_digits", comp(logit_bias={"9" * 5000: 1.0}), param="logit_bias"),
    C("logit_bias_key_arabic_indic_three", comp(logit_bias={"٣": 1.0}), param="logit_bias"),
    C("logit_bias_key_fullwidth_twelve", comp(logit_bias={"１２": 1.0}), param="logit_bias"),
    # ---- grammars that compile but cannot be followed: a 400, never a 200 "stop" that breaks them --
    C("schema_anyof_2500_one_key_objects", chat(response_format=json_schema_format({"anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"],
         "additionalProperties": False} for i in range(2500)]})),
      param="response_format", path="/v1/chat/completions"),
    C("schema_cyclic_ref", chat(response_format=json_schema_format(
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}})),
      param="response_format", path="/v1/chat/completions"),
    # ---- Responses metadata: OpenAI's limits (stored responses keep it) ------------------------
    C("responses_metadata_17_pairs", {"model": "__MODEL__", "input": "hi", "metadata": {str(i): "v" for i in range(17)}},
      param="metadata", path="/v1/responses"),
    C("responses_metadata_key_65_chars", {"model": "__MODEL__", "input": "hi", "metadata": {"k" * 65: "v"}},
      param="metadata", path="/v1/responses"),
    C("responses_metadata_value_513_chars", {"model": "__MODEL__", "input": "hi", "metadata": {"k": "v" * 513}},
      param="metadata", path="/v1/responses"),
    C("chat_metadata_value_1mb", chat(metadata={"k": "v" * MIB}), param="metadata", path="/v1/chat/completions"),
    # ---- text the tokenizer cannot take ---------------------------------------------------
    C("lone_surrogate_prompt", raw(r'{"model": "__MODEL__", "prompt": "hi \ud800 there", "max_tokens": 4}'),
      param=("prompt", None)),
    C("lone_surrogate_stop", raw(r'{"model": "__MODEL__", "prompt": "hi", "max_tokens": 4, "stop": ["\udfff"]}'),
      param=("stop", None)),
    # ---- context length -------------------------------------------------------------------
    C("prompt_over_context", comp(prompt=LONG_PROMPT, max_tokens=1), param="prompt", code="context_length_exceeded"),
    C("prompt_plus_max_tokens_over_context", comp(prompt="hello " * 450, max_tokens=100),
      param=("max_tokens", "prompt", None), code="context_length_exceeded"),
    # ---- unknown model ---------------------------------------------------------------------
    C("unknown_model", comp(model="no-such-model"), status=404, param=("model", None)),
    # ---- chat --------------------------------------------------------------------------------
    C("chat_missing_messages", {"model": "__MODEL__"}, param="messages", path="/v1/chat/completions"),
    C("chat_empty_messages", chat(messages=[]), param="messages", path="/v1/chat/completions"),
    C("chat_messages_is_a_string", chat(messages="hi"), param="messages", path="/v1/chat/completions"),
    C("chat_message_is_a_string", chat(messages=["hi"]), param="messages", path="/v1/chat/completions"),
    C("chat_unknown_role", chat(messages=[{"role": "wizard", "content": "hi"}]), param="messages",
      path="/v1/chat/completions"),
    C("chat_missing_role", chat(messages=[{"content": "hi"}]), param="messages", path="/v1/chat/completions"),
    C("chat_content_is_a_number", chat(messages=[{"role": "user", "content": 123}]), param="messages",
      path="/v1/chat/completions"),
    C("chat_content_part_unknown_type",
      chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
      param="messages", path="/v1/chat/completions"),
    C("chat_lone_surrogate_content",
      raw(r'{"model": "__MODEL__", "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 4}'),
      param=("messages", None), path="/v1/chat/completions"),
    C("cache_salt_empty", comp(cache_salt=""), param="cache_salt"),
    C("cache_salt_is_a_number", comp(cache_salt=42), param="cache_salt"),
    C("cache_salt_too_long", comp(cache_salt="s" * 1025), param="cache_salt"),
    C("chat_cache_salt_is_a_list", chat(cache_salt=["a"]), param="cache_salt", path="/v1/chat/completions"),
    C("chat_top_logprobs_50", chat(logprobs=True, top_logprobs=50), param="top_logprobs", path="/v1/chat/completions"),
    C("chat_top_logprobs_without_logprobs", chat(top_logprobs=2), param="top_logprobs", path="/v1/chat/completions"),
    C("chat_max_completion_tokens_negative", chat(max_completion_tokens=-1), param="max_completion_tokens",
      path="/v1/chat/completions"),
    C("chat_n_1000", chat(n=1000), param="n", path="/v1/chat/completions"),
    C("chat_nan_top_p",
      raw('{"model": "__MODEL__", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_p": NaN}'),
      param=("top_p", None), path="/v1/chat/completions"),
    C("chat_prompt_over_context", chat(messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=1),
      param="messages", code="context_length_exceeded", path="/v1/chat/completions"),
    C("chat_unknown_model", chat(model="no-such-model"), status=404, param=("model", None), path="/v1/chat/completions"),
    # ---- tokenize / detokenize ---------------------------------------------------------------
    C("tokenize_missing_prompt", {"model": "__MODEL__"}, param=("prompt", "messages", None), path="/tokenize"),
    C("detokenize_token_out_of_vocab", {"model": "__MODEL__", "tokens": [999_999]}, param="tokens", path="/detokenize"),
    C("detokenize_tokens_is_a_string", {"model": "__MODEL__", "tokens": "abc"}, param="tokens", path="/detokenize"),
    # ---- routes, methods, sizes ----------------------------------------------------------------
    C("unknown_route_get", None, status=404, param=None, method="GET", path="/v1/nothing-here"),
    C("unknown_route_post", comp(), status=404, param=None, path="/v2/completions"),
    C("wrong_method_get_completions", None, status=405, param=None, method="GET", path="/v1/completions"),
    C("wrong_method_delete_chat", None, status=405, param=None, method="DELETE", path="/v1/chat/completions"),
    C("wrong_method_post_health", None, status=405, param=None, method="POST", path="/health"),
    C("oversize_body", oversize, status=413, param=None),
    C("oversize_body_chunked", oversize, status=413, param=None, chunked=True),
]


def _param_matches(actual, expected) -> bool:
    if expected is ANY:
        return True
    if isinstance(expected, tuple):
        return any(_param_matches(actual, e) for e in expected)
    if expected is None or actual is None:
        return actual is expected
    return actual == expected or actual.startswith((expected + ".", expected + "["))


def _body_bytes(case: Case, model: str) -> bytes | None:
    body = case.body
    if body is None:
        return None
    if callable(body):
        return body(model)
    if isinstance(body, bytes):
        return body.replace(b"__MODEL__", model.encode())
    return json.dumps(body).replace("__MODEL__", model).encode()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request(case: Case, server_url, model_name, helpers):
    content = _body_bytes(case, model_name)
    headers = {"Content-Type": "application/json", **case.headers} if content is not None else dict(case.headers)
    if case.chunked:
        data = content
        content = iter([data[i:i + 64 * 1024] for i in range(0, len(data), 64 * 1024)])
    with httpx.Client(timeout=60) as http:
        r = http.request(case.method, f"{server_url}{case.path}", content=content, headers=headers)
    assert r.status_code not in (422, 500), f"{r.status_code}: {r.text[:500]}"
    assert r.status_code == case.status, f"expected {case.status}, got {r.status_code}: {r.text[:500]}"
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    err = helpers.assert_error_envelope(r.json())
    assert _param_matches(err["param"], case.param), f"param {err['param']!r}, expected {case.param!r}: {err}"
    if case.code is not ANY:
        assert err["code"] == case.code, err
    if case.status == 400:
        assert err["type"] == "invalid_request_error" or err["type"].endswith("Error"), err


def test_table_is_big_enough():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


def test_server_still_serves_after_bad_input(client, server_url, model_name):
    """Runs after the table (file order): no bad request left the server broken."""
    assert httpx.get(f"{server_url}/health", timeout=10).status_code == 200
    out = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.choices[0].text
    assert out.usage.completion_tokens >= 1
    chat_out = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat_out.choices[0].message.content

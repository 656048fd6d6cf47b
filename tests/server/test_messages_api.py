"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the official
`anthropic` SDK and httpx, against the session server and the bundled model (greedy).

What a Claude Code or Anthropic SDK user would notice: the SDK's create and stream agree,
a tool round trip works, stop reasons and usage are Anthropic's, the prefix cache shows as
`cache_read_input_tokens`, bad input is a 4xx in Anthropic's envelope, and a client that
leaves mid-stream frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import QueueFullError, RequestTimeoutError
from server.errors import ServiceUnavailableError, anthropic_sse_error_event, error_response, to_api_error
from server.protocol import known_fields
from server.protocol_anthropic import MessagesRequest

TABLE = Path(__file__).resolve().parents[2] / "docs" / "REQUEST_FIELDS.md"
BEGIN, END = "<!-- messages-fields:begin -->", "<!-- messages-fields:end -->"
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def claude(server_url) -> anthropic.Anthropic:
    # max_retries=0: a retried request would hide the status the server first answered.
    return anthropic.Anthropic(base_url=server_url, api_key="x", max_retries=0, timeout=120)


def _blocks(message) -> list[dict]:
    """Content blocks without their (per-response) ids."""
    out = []
    for block in message.content:
        if block.type == "text":
            out.append({"type": "text", "text": block.text})
        else:
            out.append({"type": block.type, "name": block.name, "input": block.input})
    return out


def _sse(body: str) -> list[tuple[str, dict]]:
    """(event name, data) of each event of an SSE body."""
    events = []
    for chunk in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def _endpoint_samples(url: str) -> dict[tuple[str, str, str], float]:
    r = httpx.get(f"{url}/metrics", timeout=10)
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if "endpoint" in s.labels:
                out[(s.name, s.labels["endpoint"], s.labels.get("finished_reason", ""))] = s.value
    return out


# ---- the SDK: create, stream, tools, stops, usage ----------------------------------------------
def test_create_and_stream_agree(claude, model_name):
    kwargs = dict(model=model_name, max_tokens=8, system="You are terse.",
                  messages=[{"role": "user", "content": "Name three colors."}], extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == model_name
    assert _blocks(whole) == _blocks(streamed) and whole.content[0].text == text != ""
    assert (whole.stop_reason, whole.stop_sequence) == (streamed.stop_reason, streamed.stop_sequence)
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.output_tokens == streamed.usage.output_tokens <= 8
    total = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert total == streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens
    assert total == claude.messages.count_tokens(model=model_name, system=kwargs["system"],
                                                 messages=kwargs["messages"]).input_tokens


def test_stream_events_are_anthropics(server_url, model_name):
    body = {"model": model_name, "max_tokens": 6, "stream": True, **GREEDY,
            "messages": [{"role": "user", "content": "Say hello."}]}
    r = httpx.post(f"{server_url}/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = _sse(r.text)
    assert all(name == data["type"] for name, data in events), events
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"], names
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names
    assert set(names[3:-3]) == {"content_block_delta"}, names
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in events[3:-3])
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 6


def test_tool_round_trip(claude, model_name):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=model_name, max_tokens=40, messages=messages, tools=[WEATHER],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    call = claude.messages.create(**kwargs)
    assert call.stop_reason == "tool_use", call
    [use] = [b for b in call.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with claude.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert _blocks(streamed) == _blocks(call) and streamed.stop_reason == "tool_use"
    answer = claude.messages.create(
        model=model_name, max_tokens=2, tools=[WEATHER], extra_body=GREEDY,
        messages=[*messages, {"role": "assistant", "content": call.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "Sunny, 24 degrees Celsius"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use"), answer
    assert answer.content and answer.usage.output_tokens > 0


def test_stop_sequences(claude, model_name):
    kwargs = dict(model=model_name, max_tokens=10, messages=[{"role": "user", "content": "Count to ten."}],
                  extra_body=GREEDY)
    text = claude.messages.create(**kwargs).content[0].text
    words = re.findall(r"[A-Za-z]{3,}|\d", text)
    assert len(words) >= 2, text
    stop = words[1]
    stopped = claude.messages.create(**kwargs, stop_sequences=["@@never@@", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:text.index(stop)]


def test_max_tokens_stop_reason_and_endpoint_metrics(claude, model_name, server_url):
    before = _endpoint_samples(server_url)
    message = claude.messages.create(model=model_name, max_tokens=3, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "Tell me a long story."}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    after = _endpoint_samples(server_url)
    key = ("pagoda:endpoint_generation_tokens_total", "messages", "")
    assert after[key] - before.get(key, 0) == 3


def test_max_tokens_past_the_context_is_a_ceiling(claude, model_name, helpers):
    """Claude Code sends a max_tokens far past a small model's context: the reply gets the
    room its prompt leaves and says so with stop_reason model_context_window_exceeded."""
    messages = [{"role": "user", "content": "Repeat: " + "red blue " * 232}]
    room = helpers.MAX_MODEL_LEN - claude.messages.count_tokens(model=model_name, messages=messages).input_tokens
    assert 0 < room <= 32, room
    message = claude.messages.create(model=model_name, max_tokens=32000, messages=messages, extra_body=GREEDY)
    assert (message.stop_reason, message.usage.output_tokens) == ("model_context_window_exceeded", room)


def test_repeated_long_system_prompt_reads_the_prefix_cache(claude, model_name):
    system = "You are a careful assistant for a weather service. " * 24
    kwargs = dict(model=model_name, max_tokens=2, system=system, extra_body=GREEDY)
    first = claude.messages.create(**kwargs, messages=[{"role": "user", "content": "Hi"}])
    second = claude.messages.create(**kwargs, messages=[{"role": "user", "content": "Hello"}])
    assert second.usage.cache_read_input_tokens >= 160, (first.usage, second.usage)
    count = claude.messages.count_tokens(model=model_name, system=system,
                                         messages=[{"role": "user", "content": "Hello"}]).input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == count
    assert second.usage.cache_creation_input_tokens == 0


def test_count_tokens_counts_tools_and_prefill(claude, model_name):
    messages = [{"role": "user", "content": "Weather?"}]
    plain = claude.messages.count_tokens(model=model_name, messages=messages).input_tokens
    with_tools = claude.messages.count_tokens(model=model_name, messages=messages, tools=[WEATHER]).input_tokens
    assert with_tools > plain
    used = claude.messages.create(model=model_name, max_tokens=1, messages=messages, tools=[WEATHER],
                                  extra_body=GREEDY).usage
    assert used.input_tokens + used.cache_read_input_tokens == with_tools
    # A last assistant turn is a prefill: the reply continues it (no new turn is opened).
    prefill = [*messages, {"role": "assistant", "content": "The weather"}]
    continued = claude.messages.create(model=model_name, max_tokens=1, messages=prefill, extra_body=GREEDY).usage
    assert continued.input_tokens + continued.cache_read_input_tokens == claude.messages.count_tokens(
        model=model_name, messages=prefill).input_tokens


def test_output_config_json_schema(claude, model_name):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    message = claude.messages.create(model=model_name, max_tokens=30, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "Pick a color."}],
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_errors_reach_the_sdk_as_its_exceptions(claude, model_name):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model_name, max_tokens=2048, messages=[{"role": "user", "content": "Hi"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert e.value.body["error"]["message"].startswith("thinking")


# ---- Anthropic's error statuses and the mid-stream error event (no server needed) ---------------
@pytest.mark.parametrize("error, status, error_type", [
    (QueueFullError("the server is at its limit of 4 queued requests"), 529, "overloaded_error"),
    (ServiceUnavailableError("the server is shutting down", code="server_draining"), 529, "overloaded_error"),
    (ServiceUnavailableError("the engine is not running", code="engine_dead"), 500, "api_error"),
    (RequestTimeoutError("past --request-timeout"), 504, "timeout_error"),
    (RuntimeError("a bug"), 500, "api_error"),
], ids=["queue_full", "draining", "engine_dead", "timeout", "unexpected"])
def test_anthropic_statuses_and_error_event(error, status, error_type):
    api_error = to_api_error(error)
    response = error_response(api_error, "/v1/messages")
    assert response.status_code == status
    body = json.loads(response.body)
    assert body == {"type": "error", "error": {"type": error_type, "message": api_error.message}}
    assert error_response(api_error, "/v1/chat/completions").status_code == api_error.status_code  # OpenAI's routes
    event = anthropic_sse_error_event(error)
    assert event == b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"


# ---- a client that leaves mid-stream -----------------------------------------------------------
def test_aborted_stream_frees_every_kv_block(server_url, model_name, helpers):
    before = helpers.wait_idle(server_url)
    assert helpers.idle(before)
    aborted_before = _endpoint_samples(server_url).get(("pagoda:endpoint_requests_total", "messages", "abort"), 0)
    body = {"model": model_name, "max_tokens": 300, "stream": True, **GREEDY,
            "messages": [{"role": "user", "content": "Count from one to one hundred, one number per line."}]}

    async def leave_early(http, i):
        prompt = {**body, "messages": [{"role": "user", "content": f"{i}. {body['messages'][0]['content']}"}]}
        async with http.stream("POST", "/v1/messages", json=prompt) as r:
            assert r.status_code == 200, await r.aread()
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("event: content_block_delta")
                if seen >= 3:
                    return  # leaving the block closes the connection mid-stream

    async def run():
        async with httpx.AsyncClient(base_url=server_url, timeout=120) as http:
            await asyncio.gather(*(leave_early(http, i) for i in range(3)))

    asyncio.run(run())
    after = helpers.wait_idle(server_url)
    assert helpers.idle(after), after
    aborted = _endpoint_samples(server_url)[("pagoda:endpoint_requests_total", "messages", "abort")]
    assert aborted - aborted_before == 3


# ---- bad input: 4xx in Anthropic's envelope, never a 500 ----------------------------------------
USER = [{"role": "user", "content": "Hi"}]
TOOL_TURN = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]}]
BASE = {"max_tokens": 2, "messages": USER}

# (id, body (dict, merged over BASE, a key set to None is removed) or raw bytes, status, error type, needle)
BAD = [
    ("no_max_tokens", {"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ("max_tokens_zero", {"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ("max_tokens_string", {"max_tokens": "5"}, 400, "invalid_request_error", "max_tokens"),
    ("no_messages", {"messages": None}, 400, "invalid_request_error", "messages"),
    ("messages_empty", {"messages": []}, 400, "invalid_request_error", "messages"),
    ("messages_string", {"messages": "Hi"}, 400, "invalid_request_error", "messages"),
    ("role_system", {"messages": [{"role": "system", "content": "Hi"}]}, 400, "invalid_request_error",
     "messages[0].role"),
    ("no_content", {"messages": [{"role": "user"}]}, 400, "invalid_request_error", "messages[0].content"),
    ("empty_user_content", {"messages": [{"role": "user", "content": ""}]}, 400, "invalid_request_error",
     "messages[0].content"),
    ("image_block", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "messages[0].content[0]"),
    ("block_not_object", {"messages": [{"role": "user", "content": ["Hi"]}]}, 400, "invalid_request_error",
     "messages[0].content[0]"),
    ("text_block_without_text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].text"),
    ("empty_text_block", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].text"),
    ("tool_use_in_user_turn", {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400, "invalid_request_error",
     "messages[0].content[0]"),
    ("tool_result_in_assistant_turn", {"messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, 400, "invalid_request_error",
     "messages[1].content[0]"),
    ("tool_result_unknown_id", {"messages": [*TOOL_TURN, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "Sunny"}]}]}, 400, "invalid_request_error",
     "messages[2].content[0].tool_use_id"),
    ("tool_result_without_tool_use", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}]}, 400, "invalid_request_error",
     "tool_use_id"),
    ("tool_use_input_not_object", {"messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}, *USER]}, 400, "invalid_request_error",
     "messages[1].content[0].input"),
    ("tool_use_ids_repeat", {"messages": [*TOOL_TURN, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}, TOOL_TURN[1]]}, 400,
     "invalid_request_error", "messages[3].content[0].id"),
    ("unanswered_tool_use_last", {"messages": TOOL_TURN}, 400, "invalid_request_error", "messages[1]"),
    ("tool_result_is_error_not_bool", {"messages": [*TOOL_TURN, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x", "is_error": "yes"}]}]}, 400,
     "invalid_request_error", "is_error"),
    ("tool_choice_any_without_tools", {"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    ("tool_choice_tool_without_name", {"tools": [WEATHER], "tool_choice": {"type": "tool"}}, 400,
     "invalid_request_error", "tool_choice"),
    ("tool_choice_unknown_tool", {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "tool_choice"),
    ("tool_choice_bad_type", {"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, 400,
     "invalid_request_error", "tool_choice"),
    ("tool_choice_string", {"tools": [WEATHER], "tool_choice": "any"}, 400, "invalid_request_error", "tool_choice"),
    ("tool_without_input_schema", {"tools": [{"name": "f"}]}, 400, "invalid_request_error",
     "tools[0].input_schema"),
    ("tool_schema_not_object", {"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, 400,
     "invalid_request_error", "tools[0].input_schema"),
    ("server_tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "tools[0].type"),
    ("tool_bad_name", {"tools": [{"name": "get weather", "input_schema": {"type": "object"}}]}, 400,
     "invalid_request_error", "tools[0].name"),
    ("tool_names_repeat", {"tools": [WEATHER, WEATHER]}, 400, "invalid_request_error", "tools"),
    ("tool_input_examples", {"tools": [{**WEATHER, "input_examples": [{"city": "Paris"}]}]}, 400,
     "invalid_request_error", "tools[0].input_examples"),
    ("temperature_above_one", {"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ("top_p_zero", {"top_p": 0}, 400, "invalid_request_error", "top_p"),
    ("top_k_negative", {"top_k": -1}, 400, "invalid_request_error", "top_k"),
    ("stop_sequences_string", {"stop_sequences": "x"}, 400, "invalid_request_error", "stop_sequences"),
    ("stop_sequence_empty", {"stop_sequences": [""]}, 400, "invalid_request_error", "stop_sequences"),
    ("system_number", {"system": 5}, 400, "invalid_request_error", "system"),
    ("system_image_block", {"system": [{"type": "image"}]}, 400, "invalid_request_error", "system[0]"),
    ("thinking_enabled_without_a_reasoning_format", {"max_tokens": 2048, "thinking": {"type": "enabled",
     "budget_tokens": 1024}}, 400, "invalid_request_error", "no reasoning format"),
    ("thinking_budget_not_below_max_tokens", {"max_tokens": 1024, "thinking": {"type": "enabled",
     "budget_tokens": 1024}}, 400, "invalid_request_error", "must be greater than thinking.budget_tokens"),
    ("thinking_block_in_a_user_turn", {"messages": [{"role": "user", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "x"}]}]}, 400, "invalid_request_error",
     "belong to assistant messages"),
    ("thinking_without_budget", {"thinking": {"type": "enabled"}}, 400, "invalid_request_error", "thinking"),
    ("output_format_bad_schema", {"output_config": {"format": {"type": "json_schema", "schema": {"type": 5}}}},
     400, "invalid_request_error", "output_config.format"),
    ("container", {"container": "container_1"}, 400, "invalid_request_error", "container"),
    ("metadata_user_id_number", {"metadata": {"user_id": 5}}, 400, "invalid_request_error", "metadata.user_id"),
    ("stream_not_bool", {"stream": "yes"}, 400, "invalid_request_error", "stream"),
    ("prompt_longer_than_context", {"messages": [{"role": "user", "content": "word " * 900}]}, 400,
     "invalid_request_error", "messages"),
    ("unknown_model", {"model": "no-such-model"}, 404, "not_found_error", "no-such-model"),
    ("bad_json", b'{"model": "m", "max_tokens": 2,', 400, "invalid_request_error", "JSON"),
    ("json_array", b"[1, 2]", 400, "invalid_request_error", "JSON object"),
    ("empty_body", b"", 400, "invalid_request_error", "empty"),
    ("nan", b'{"max_tokens": 2, "temperature": NaN, "messages": []}', 400, "invalid_request_error", "NaN"),
    ("oversized_body", {"system": "x" * (2 * 1024 * 1024 + 10)}, 413, "request_too_large", "limit"),
]


def _bad_request(model_name: str, body) -> bytes:
    if isinstance(body, bytes):
        return body
    merged = {"model": model_name, **BASE, **body}
    return json.dumps({k: v for k, v in merged.items() if v is not None}).encode()


def _assert_anthropic_error(r: httpx.Response, status: int, error_type: str, needle: str) -> None:
    assert r.status_code == status, r.text[:400]
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == error_type, body
    assert needle in body["error"]["message"], body


@pytest.mark.parametrize("body, status, error_type, needle", [case[1:] for case in BAD], ids=[c[0] for c in BAD])
def test_bad_input_gets_anthropics_envelope(server_url, model_name, body, status, error_type, needle):
    r = httpx.post(f"{server_url}/v1/messages", content=_bad_request(model_name, body),
                   headers={"content-type": "application/json", "anthropic-version": "2023-06-01"}, timeout=60)
    _assert_anthropic_error(r, status, error_type, needle)


@pytest.mark.parametrize("method, path, body, status, error_type", [
    ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400,
     "invalid_request_error"),
    ("POST", "/v1/messages/count_tokens", {"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400,
     "invalid_request_error"),
    ("POST", "/v1/messages/batches", {}, 404, "not_found_error"),
    ("GET", "/v1/messages", None, 405, "invalid_request_error"),
], ids=["count_tokens_image", "count_tokens_thinking", "unknown_route", "wrong_method"])
def test_the_other_messages_routes_answer_in_anthropics_envelope(server_url, model_name, method, path, body, status,
                                                                 error_type):
    kwargs = {"json": {"model": model_name, "messages": USER, **body}} if body is not None else {}
    r = httpx.request(method, f"{server_url}{path}", timeout=60, **kwargs)
    assert r.status_code == status, r.text[:400]
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == error_type, r.text


# ---- docs/REQUEST_FIELDS.md's Messages table ----------------------------------------------------
def _table_rows() -> list[tuple[str, str, object, dict]]:
    text = TABLE.read_text()
    lines = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip().splitlines()[2:]
    rows = []
    for line in lines:
        field, status, value, with_ = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]][:4]
        cell = lambda c: json.loads(c.strip("`")) if c else {}  # noqa: E731
        rows.append((field.strip("`"), status, cell(value), cell(with_)))
    return rows


ROWS = _table_rows()


def test_every_messages_field_has_a_row():
    listed = {field for field, *_ in ROWS}
    missing = sorted(name for name in known_fields(MessagesRequest) if name != "model" and name not in listed)
    assert not missing, f"no row in {TABLE.name}'s Messages table for {missing}"


@pytest.mark.parametrize("field, status, value, with_", ROWS, ids=[row[0] for row in ROWS])
def test_messages_field_is_implemented_a_noop_or_refused(server_url, model_name, field, status, value, with_):
    assert status in ("implemented", "no-op", "400"), status
    body = {"model": model_name, **BASE, **with_, field: value}
    r = httpx.post(f"{server_url}/v1/messages", json=body, timeout=60)
    if status == "400":
        _assert_anthropic_error(r, 400, "invalid_request_error", field)
        assert r.json()["error"]["message"].startswith(field), r.text
        return
    assert r.status_code == 200, r.text[:400]
    assert field in known_fields(MessagesRequest), f"{field} is accepted but no request model reads it"

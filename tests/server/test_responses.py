"""The Responses API through the real server and the official `openai` client: text, instructions,
JSON-schema output, a function-call round trip over previous_response_id, streamed events in
OpenAI's order, GET / DELETE, max_output_tokens, bad input, disconnects and metrics."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

# A Responses function tool: flat, no nested "function".
WEATHER = {"type": "function", "name": "get_forecast", "description": "The weather forecast for a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                          "properties": {"city": {"type": "string", "maxLength": 30},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

MAX_JSON_TOKENS = 200
KV_USAGE = "pagoda:kv_cache_usage_perc"
RUNNING = "pagoda:num_requests_running"
WAITING = "pagoda:num_requests_waiting"
DISCONNECTED = "pagoda:http_requests_client_disconnected_total"


def endpoint_samples(url: str) -> dict[tuple[str, ...], float]:
    """The per-endpoint series: (sample name, endpoint[, finished_reason]) -> value."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200, r.text
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if "endpoint" in s.labels:
                key = (s.name, s.labels["endpoint"], *([s.labels["finished_reason"]] if "finished_reason" in s.labels
                                                       else []))
                out[key] = s.value
    return out


def test_string_input_gives_output_text(client, model_name):
    r = client.responses.create(model=model_name, input="What is the capital of France?", max_output_tokens=24,
                                temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model_name
    assert r.status == "completed" and r.error is None and r.incomplete_details is None
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert [p.type for p in message.content] == ["output_text"]
    assert r.output_text == message.content[0].text and "Paris" in r.output_text
    assert 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_instructions_and_list_input_render_as_the_chat_path(client, model_name):
    """instructions + message items with input_text parts are the chat request with a system
    message: greedy, both endpoints give the same text."""
    instructions = "You answer in one short sentence."
    question = [{"type": "input_text", "text": "Name a primary colour."}]
    r = client.responses.create(
        model=model_name, instructions=instructions, max_output_tokens=24, temperature=0,
        input=[{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?"},
               {"type": "message", "role": "user", "content": question}])
    chat = client.chat.completions.create(
        model=model_name, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": instructions}, {"role": "user", "content": "Hello!"},
                  {"role": "assistant", "content": "Hi, how can I help?"},
                  {"role": "user", "content": "Name a primary colour."}])
    assert r.status == "completed"
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == instructions
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_json_schema_output_validates(client, model_name):
    r = client.responses.create(
        model=model_name, input="Invent a person and give their name and age.", max_output_tokens=80, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert r.status == "completed", r.incomplete_details
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


def test_json_object_output_parses(client, model_name):
    r = client.responses.create(model=model_name, input="Describe a cat as a JSON object with keys name and color.",
                                max_output_tokens=MAX_JSON_TOKENS, temperature=0,
                                text={"format": {"type": "json_object"}})
    assert r.status == "completed"
    assert isinstance(json.loads(r.output_text), dict)


def test_function_call_then_previous_response_id_with_its_output(client, model_name):
    first = client.responses.create(
        model=model_name, input="What is the weather like in Paris today?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_forecast" and call.call_id and call.id
    assert call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    second = client.responses.create(
        model=model_name, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=40, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 18}'}])
    assert second.previous_response_id == first.id
    assert second.status in ("completed", "incomplete")
    assert second.output and second.output[0].type in ("message", "function_call")
    # The stored conversation is the prompt's prefix: its blocks come from the prefix cache.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2


def test_output_items_sent_back_as_input_without_the_store(client, model_name):
    """Stateless use (agents with store=false): the previous output items go back as input."""
    first = client.responses.create(
        model=model_name, input="Weather in Rome?", tools=[WEATHER], parallel_tool_calls=False, store=False,
        tool_choice={"type": "function", "name": "get_forecast"}, max_output_tokens=80, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_forecast"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    history = [{"role": "user", "content": "Weather in Rome?"}, *[item.model_dump(exclude_none=True)
                                                                  for item in first.output]]
    second = client.responses.create(
        model=model_name, store=False, tools=[WEATHER], max_output_tokens=16, temperature=0,
        input=[*history, {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    assert second.status in ("completed", "incomplete") and second.output


def test_readme_example_runs(server_url, capsys):
    """The README's Responses API example, as written, against this server."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("\n## Responses API\n"):]
    start = section.index("```python\n") + len("```python\n")
    code = section[start:section.index("```", start)]
    assert "client.responses.create(" in code and "client.responses.stream(" in code
    exec(compile(code.replace("http://localhost:8000/v1", f"{server_url}/v1"), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()


# OpenAI's order for one message item.
TEXT_EVENTS = re.compile(
    r"response\.created response\.in_progress response\.output_item\.added response\.content_part\.added"
    r"( response\.output_text\.delta)+ response\.output_text\.done response\.content_part\.done"
    r" response\.output_item\.done response\.completed")


def test_streamed_events_in_order_and_deltas_equal_the_text(client, model_name):
    with client.responses.stream(model=model_name, input="Write one sentence about the sea.",
                                 max_output_tokens=200, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = " ".join(e.type for e in events)
    assert TEXT_EVENTS.fullmatch(types), types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == final.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas
    assert final.status == "completed" and final.id == events[0].response.id
    # The stored response is the streamed one, and greedy decoding matches the non-streamed call.
    assert client.responses.retrieve(final.id).output_text == deltas
    plain = client.responses.create(model=model_name, input="Write one sentence about the sea.",
                                    max_output_tokens=200, temperature=0)
    assert plain.output_text == deltas


def test_streamed_function_call_arguments(client, model_name):
    events = list(client.responses.create(
        model=model_name, input="What is the weather like in Oslo?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=80, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.name == "get_forecast" and added.arguments == ""
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == events[-3].arguments == done.arguments == events[-1].response.output[0].arguments
    assert done.call_id == added.call_id and done.id == added.id
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])


def test_get_and_delete_by_id(client, model_name, server_url, helpers):
    r = client.responses.create(model=model_name, input="Hi", max_output_tokens=4, metadata={"run": "7"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"run": "7"}
    deleted = httpx.delete(f"{server_url}/v1/responses/{r.id}", timeout=10)
    assert deleted.status_code == 200 and deleted.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    for response in (httpx.get(f"{server_url}/v1/responses/{r.id}", timeout=10),
                     httpx.delete(f"{server_url}/v1/responses/{r.id}", timeout=10)):
        assert response.status_code == 404
        assert helpers.assert_error_envelope(response.json())["code"] == "not_found"
    unstored = client.responses.create(model=model_name, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_max_output_tokens_gives_incomplete(client, model_name):
    r = client.responses.create(model=model_name, input="Tell me a long story about a dragon.",
                                max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete" and r.output_text
    events = list(client.responses.create(model=model_name, input="Tell me a long story about a dragon.",
                                          max_output_tokens=5, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == r.output_text


LONG_TEXT = "word " * 600
BAD_REQUESTS = [
    ("unknown_previous_id", {"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ("web_search_tool", {"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ("file_search_tool", {"input": "hi", "tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]},
     400, "tools[1]"),
    ("built_in_tool_choice", {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}},
     400, "tool_choice"),
    ("choice_not_among_tools", {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
     400, "tool_choice"),
    ("required_without_tools", {"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ("unknown_item_type", {"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0]"),
    ("item_not_an_object", {"input": ["hi"]}, 400, "input[0]"),
    ("message_without_role", {"input": [{"type": "message", "content": "hi"}]}, 400, "input[0].role"),
    ("image_part", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": "http://x/y.png"}]}]},
     400, "input[0].content[1]"),
    ("file_part", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     400, "input[0].content[0]"),
    ("call_without_call_id", {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     400, "input[0].call_id"),
    ("output_without_output", {"input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "input[0].output"),
    ("item_reference", {"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0]"),
    ("input_missing", {"instructions": "x"}, 400, "input"),
    ("input_a_number", {"input": 3}, 400, "input"),
    ("reasoning", {"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ("background", {"input": "hi", "background": True}, 400, "background"),
    ("include", {"input": "hi", "include": ["message.output_text.logprobs"]}, 400, "include"),
    ("conversation", {"input": "hi", "conversation": "conv_1"}, 400, "conversation"),
    ("truncation_auto", {"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ("format_without_schema", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     400, "text.format"),
    ("format_unknown_type", {"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ("schema_that_does_not_compile", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     400, "text.format"),
    ("max_output_tokens_zero", {"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ("max_output_tokens_past_context", {"input": "hi", "max_output_tokens": 100000}, 400, "max_output_tokens"),
    ("input_past_context", {"input": LONG_TEXT}, 400, "input"),
    ("temperature_string", {"input": "hi", "temperature": "0.5"}, 400, "temperature"),
    ("unknown_model", {"input": "hi", "model": "gpt-4o"}, 404, "model"),
]


@pytest.mark.parametrize("body, status, param", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_are_clean_4xx(server_url, model_name, helpers, body, status, param):
    r = httpx.post(f"{server_url}/v1/responses", json={"model": model_name, **body}, timeout=60)
    assert r.status_code == status, r.text
    err = helpers.assert_error_envelope(r.json())
    assert err["param"] == param, err


# Items and fields as clients send them, right and wrong: every body is answered 200 or a 4xx
# in the envelope, never a 5xx.
_TEXT = st.text(max_size=12)
_JUNK = st.one_of(st.none(), st.integers(-2, 3), st.booleans(), _TEXT, st.lists(st.integers(), max_size=2))
_PART = st.one_of(st.fixed_dictionaries({"type": st.just("input_text"), "text": _TEXT}),
                  st.fixed_dictionaries({"type": st.sampled_from(["input_image", "output_text", "x"]), "text": _JUNK}))
_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool", "bot"]),
                           "content": st.one_of(_TEXT, st.lists(_PART, max_size=2), _JUNK)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.one_of(_TEXT, _JUNK),
                           "name": st.just("get_forecast"), "arguments": st.one_of(st.just('{"city": "Oslo"}'), _JUNK)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": _TEXT,
                           "output": st.one_of(_TEXT, st.lists(_PART, max_size=2), _JUNK)}),
    _JUNK)
_BODY = st.fixed_dictionaries({"input": st.one_of(_TEXT.filter(bool), st.lists(_ITEM, min_size=1, max_size=3), _JUNK)},
                              optional={
    "instructions": st.one_of(_TEXT, _JUNK),
    "max_output_tokens": st.one_of(st.integers(-1, 4), _JUNK),
    "temperature": st.one_of(st.floats(-1, 3), _JUNK),
    "tools": st.one_of(st.just([WEATHER]), st.just([{"type": "web_search"}]), _JUNK),
    "tool_choice": st.sampled_from(["auto", "none", "required", "any", {"type": "function", "name": "get_forecast"},
                                    {"type": "function", "name": "nope"}, {"type": "file_search"}]),
    "text": st.sampled_from([{"format": {"type": "json_object"}}, {"format": {"type": "text"}}, {"format": {}},
                             {"format": {"type": "json_schema", "name": "p", "schema": PERSON}}, "json"]),
    "previous_response_id": st.one_of(st.just("resp_missing"), _JUNK),
    "store": _JUNK, "stream": st.booleans(), "metadata": st.one_of(st.just({"k": "v"}), _JUNK),
    "reasoning": st.one_of(st.just({"effort": "low"}), st.none()),
})


def test_fuzzed_bodies_get_200_or_a_clean_4xx(server_url, model_name, helpers):
    statuses: dict[int, int] = {}

    @settings(deadline=None, database=None, max_examples=60, suppress_health_check=list(HealthCheck))
    @given(body=_BODY)
    def fuzz(body):
        if not isinstance(body.get("max_output_tokens"), int) or body["max_output_tokens"] > 4:
            body["max_output_tokens"] = 4  # keep every generation short
        r = httpx.post(f"{server_url}/v1/responses", json=body, timeout=120)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 404), r.text
        if r.status_code != 200:
            helpers.assert_error_envelope(r.json())
        elif r.headers["content-type"].startswith("text/event-stream"):
            kinds = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
            assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
        else:
            assert r.json()["status"] in ("completed", "incomplete"), r.text

    fuzz()
    assert statuses.get(200) and statuses.get(400), statuses
    assert httpx.get(f"{server_url}/health", timeout=10).status_code == 200


def test_server_keeps_serving_after_bad_requests(server_url, model_name, helpers):
    for body in (b"{not json", b"[]", b'{"input": "hi", "stream": "yes"}'):
        r = httpx.post(f"{server_url}/v1/responses", content=body, headers={"Content-Type": "application/json"},
                       timeout=30)
        assert r.status_code == 400, r.text
        helpers.assert_error_envelope(r.json())
    assert httpx.get(f"{server_url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{server_url}/v1/responses", json={"model": model_name, "input": "Hi", "max_output_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete")


def test_disconnected_streams_are_aborted_and_free_their_kv(server_url, model_name, helpers):
    before = helpers.wait_idle(server_url)
    assert helpers.idle(before)
    aborted_before = endpoint_samples(server_url).get(("pagoda:endpoint_requests_total", "responses", "abort"), 0)
    num_streams = 6

    async def stream(http, i):
        body = {"model": model_name, "input": f"{i}. Count from one to two hundred, one number per line.",
                "max_output_tokens": 400, "temperature": 0, "stream": True}
        async with http.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200, await r.aread()
            seen = []
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    seen.append(line[len("event: "):])
                if "response.output_text.delta" in seen:
                    return seen  # leaving the block closes the connection mid-stream
        return seen

    async def run():
        async with httpx.AsyncClient(base_url=server_url, timeout=120) as http:
            return await asyncio.gather(*(stream(http, i) for i in range(num_streams)))

    for seen in asyncio.run(run()):
        assert seen[:2] == ["response.created", "response.in_progress"] and seen[-1] == "response.output_text.delta"
    after = helpers.wait_idle(
        server_url, lambda m: helpers.idle(m) and m.get(DISCONNECTED, 0) - before[DISCONNECTED] >= num_streams)
    assert helpers.idle(after), {k: after.get(k) for k in (RUNNING, WAITING, KV_USAGE)}
    assert after[DISCONNECTED] - before[DISCONNECTED] >= num_streams
    # The aborted engine requests are counted under the endpoint they came through.
    aborted = endpoint_samples(server_url).get(("pagoda:endpoint_requests_total", "responses", "abort"), 0)
    assert aborted - aborted_before == num_streams


def test_metrics_are_labelled_by_endpoint(client, model_name, server_url):
    before = endpoint_samples(server_url)
    r = client.responses.create(model=model_name, input="Hello there", max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=6, temperature=0)
    after = endpoint_samples(server_url)

    def grew(name, endpoint):
        return after.get((name, endpoint), 0) - before.get((name, endpoint), 0)

    assert grew("pagoda:endpoint_prompt_tokens_total", "responses") == r.usage.input_tokens
    assert grew("pagoda:endpoint_generation_tokens_total", "responses") == r.usage.output_tokens
    assert grew("pagoda:endpoint_prompt_tokens_total", "chat_completions") == chat.usage.prompt_tokens
    assert grew("pagoda:endpoint_generation_tokens_total", "chat_completions") == chat.usage.completion_tokens
    assert grew("pagoda:endpoint_e2e_request_latency_seconds_count", "responses") == 1


def test_endpoint_requests_count_samples_with_the_engine_reasons(client, model_name, server_url, helpers):
    """`endpoint_requests_total` counts as `request_success_total` does: each sample, with the
    reason the engine finished it."""
    helpers.wait_idle(server_url)
    before, engine_before = endpoint_samples(server_url), helpers.scrape_metrics(server_url)
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=6, temperature=1.0, seed=3, n=3)
    after = endpoint_samples(server_url)
    engine_after = helpers.scrape_metrics(server_url)
    reasons = [c.finish_reason for c in r.choices]
    for reason in ("stop", "length", "abort"):
        key = ("pagoda:endpoint_requests_total", "chat_completions", reason)
        assert after[key] - before.get(key, 0) == reasons.count(reason), reason
    success = "pagoda:request_success_total"
    assert engine_after[success] - engine_before[success] == 3
    prompt = ("pagoda:endpoint_prompt_tokens_total", "chat_completions")
    assert after[prompt] - before[prompt] == r.usage.prompt_tokens  # the prompt once, not per sample

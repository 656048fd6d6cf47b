"""Unit tests of the Responses API pieces that need no model: the bounded store (LRU, TTL,
owners, its byte count), the owner the API-key middleware records, output items and their
stream events, and the request's checks and chat translation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.responses import JSONResponse
from starlette.testclient import TestClient

from server.app import APIKeyMiddleware
from server.tenants import KeyRegistry
from server.errors import InvalidRequestError, NotFoundError, to_api_error
from server.protocol_responses import ResponsesRequest, chat_messages, responses_param
from server.response_store import ANONYMOUS, ResponseStore, StoredResponse, key_owner
from server.serving_responses import OWNER_STATE, ResponsesServing, _Output, request_owner
from server.tools import ContentDelta, ToolCallDelta


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(i: int, owner: str = ANONYMOUS) -> StoredResponse:
    return StoredResponse(f"resp_{i}", owner, {"id": f"resp_{i}", "output": ["x" * i]},
                          [{"type": "message", "role": "user", "content": "hi"}])


# ---- the store ----------------------------------------------------------------------------------
def test_lru_evicts_the_least_recently_used_and_bytes_return_to_zero():
    store = ResponseStore(max_entries=3, ttl_s=60)
    for i in range(3):
        store.put(entry(i))
    store.get("resp_0", ANONYMOUS)  # now the most recently used
    store.put(entry(3))
    assert len(store) == 3 and store.num_evicted == 1
    with pytest.raises(NotFoundError):
        store.get("resp_1", ANONYMOUS)
    assert {e for e in ("resp_0", "resp_2", "resp_3") if store.get(e, ANONYMOUS)} == {"resp_0", "resp_2", "resp_3"}
    expected = sum(len(json.dumps([e.response, e.conversation])) for e in (entry(0), entry(2), entry(3)))
    assert store.num_bytes == expected
    for e in ("resp_0", "resp_2", "resp_3"):
        store.delete(e, ANONYMOUS)
    assert len(store) == 0 and store.num_bytes == 0


def test_byte_budget_evicts_the_least_recently_used_and_skips_what_cannot_fit():
    size = len(json.dumps([entry(500).response, entry(500).conversation]))
    store = ResponseStore(max_entries=100, ttl_s=60, max_bytes=3 * size + 5)
    for i in (500, 501, 502):  # `size` plus 0, 1, 2 bytes: they fit, and with 503 but one
        store.put(entry(i))
    store.get("resp_500", ANONYMOUS)
    store.put(entry(503))
    assert len(store) == 3 and store.num_bytes <= 3 * size + 5 and store.num_evicted == 1
    with pytest.raises(NotFoundError):
        store.get("resp_501", ANONYMOUS)
    assert store.get("resp_500", ANONYMOUS) and store.get("resp_503", ANONYMOUS)
    store.put(entry(4 * size))  # larger than the whole budget: not kept, and nothing evicted for it
    with pytest.raises(NotFoundError):
        store.get(f"resp_{4 * size}", ANONYMOUS)
    assert len(store) == 3 and store.num_evicted == 1
    with pytest.raises(ValueError):
        ResponseStore(max_entries=1, ttl_s=1, max_bytes=-1)


def test_entries_expire_after_their_ttl_since_last_use():
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl_s=30, clock=clock)
    store.put(entry(1))
    store.put(entry(2))
    clock.now += 20
    store.get("resp_1", ANONYMOUS)  # refreshed: 30 s from now
    clock.now += 15
    with pytest.raises(NotFoundError):
        store.get("resp_2", ANONYMOUS)
    assert store.get("resp_1", ANONYMOUS).id == "resp_1"
    clock.now += 31
    with pytest.raises(NotFoundError):
        store.get("resp_1", ANONYMOUS)
    assert len(store) == 0 and store.num_bytes == 0


def test_size_zero_keeps_nothing_and_bad_bounds_are_refused():
    store = ResponseStore(max_entries=0, ttl_s=1)
    store.put(entry(1))
    assert len(store) == 0 and store.num_bytes == 0
    with pytest.raises(ValueError):
        ResponseStore(max_entries=-1, ttl_s=1)
    with pytest.raises(ValueError):
        ResponseStore(max_entries=1, ttl_s=0)


def test_another_owner_gets_the_same_404_as_an_unknown_id():
    store = ResponseStore(max_entries=4, ttl_s=60)
    alice, bob = key_owner("alice-key"), key_owner("bob-key")
    assert alice != bob and ANONYMOUS not in (alice, bob) and "alice-key" not in alice
    store.put(entry(1, alice))
    for owner in (bob, ANONYMOUS):
        with pytest.raises(NotFoundError) as e:
            store.get("resp_1", owner, param="previous_response_id")
        assert e.value.status_code == 404 and e.value.param == "previous_response_id"
        with pytest.raises(NotFoundError):
            store.delete("resp_1", owner)
    assert store.get("resp_1", alice).owner == alice


def test_get_route_answers_only_the_owner():
    store = ResponseStore(max_entries=4, ttl_s=60)
    metrics = SimpleNamespace(set_response_store=lambda n, b: None)
    serving = ResponsesServing(SimpleNamespace(metrics=metrics), None, store)  # type: ignore[arg-type]
    owner = key_owner("alice-key")
    store.put(entry(7, owner))

    def request(owner_id):
        scope = {"type": "http", "state": {OWNER_STATE: owner_id}} if owner_id else {"type": "http"}
        return SimpleNamespace(scope=scope)

    assert json.loads(serving.get_response(request(owner), "resp_7").body)["id"] == "resp_7"
    for other in (key_owner("bob-key"), None):
        with pytest.raises(NotFoundError) as e:
            serving.get_response(request(other), "resp_7")
        assert to_api_error(e.value).envelope()["error"]["code"] == "not_found"
    assert json.loads(serving.delete_response(request(owner), "resp_7").body)["deleted"] is True


def test_the_api_key_middleware_records_the_owner():
    async def app(scope, receive, send):
        await JSONResponse({"owner": scope.get("state", {}).get(OWNER_STATE)})(scope, receive, send)

    client = TestClient(APIKeyMiddleware(app, KeyRegistry(api_key="alice-key")))
    assert client.get("/x", headers={"Authorization": "Bearer alice-key"}).json() == {"owner": key_owner("alice-key")}
    assert client.get("/x", headers={"Authorization": "Bearer bob-key"}).status_code == 401
    assert request_owner(SimpleNamespace(scope={"type": "http"})) == ANONYMOUS


# ---- output items and their events --------------------------------------------------------------
def types(events):
    return [e["type"].removeprefix("response.") for e in events]


def test_text_only_output_events():
    out = _Output(always_message=True)
    out.feed([ContentDelta("Hel"), ContentDelta("lo")])
    [item] = out.finish("stop")
    assert item["status"] == "completed" and item["content"][0]["text"] == "Hello"
    events = out.take_events()
    assert types(events) == ["output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
                             "output_text.done", "content_part.done", "output_item.done"]
    assert events[0]["item"]["content"] == [] and events[-1]["item"] == item


def test_calls_after_text_and_blank_text_between_them():
    out = _Output(always_message=False)
    out.feed([ContentDelta("\n"), ContentDelta("Let me check."), ContentDelta("\n"),
              ToolCallDelta(0, "", "call_a", "f"), ToolCallDelta(0, '{"x": '), ToolCallDelta(0, "1}"),
              ContentDelta("\n"), ToolCallDelta(1, "", "call_b", "g"), ToolCallDelta(1, "{}")])
    items = out.finish("stop")
    assert [i["type"] for i in items] == ["message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "\nLet me check.\n"
    assert [(i["call_id"], i["name"], i["arguments"]) for i in items[1:]] == [("call_a", "f", '{"x": 1}'),
                                                                              ("call_b", "g", "{}")]
    events = out.take_events()
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                   and e["output_index"] == 1)
    assert args == '{"x": 1}'


def test_cut_short_call_is_incomplete_and_nothing_at_all_is_an_empty_message():
    out = _Output(always_message=False)
    out.feed([ToolCallDelta(0, "", "call_a", "f"), ToolCallDelta(0, '{"x"')])
    [call] = out.finish("length")
    assert call["status"] == "incomplete" and call["arguments"] == '{"x"'
    empty = _Output(always_message=False)
    empty.feed([ContentDelta("  ")])
    [message] = empty.finish("stop")
    assert message["type"] == "message" and message["content"][0]["text"] == ""


# ---- the request ----------------------------------------------------------------------------------
def test_items_become_chat_messages():
    req = ResponsesRequest.model_validate({
        "instructions": "Be brief.",
        "input": [{"role": "developer", "content": "Use tools."},
                  {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                               {"type": "input_text", "text": "b"}]},
                  {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                   "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
                  {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "42"}]}],
    })
    assert chat_messages(req.instructions, req.items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]


def test_tools_and_text_format_translate_to_the_chat_request():
    req = ResponsesRequest.model_validate({
        "input": "hi", "max_output_tokens": 9, "tools": [{"type": "function", "name": "f", "strict": True}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}})
    body = req.to_chat_request(req.items)
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["max_completion_tokens"] == 9 and body["parallel_tool_calls"] is False
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}


@pytest.mark.parametrize("chat, responses", [
    ("messages", "input"), ("messages[3].content", "input"), ("max_tokens", "max_output_tokens"),
    ("response_format", "text.format"), ("tools", "tools"), (None, None)])
def test_chat_params_are_renamed(chat, responses):
    assert responses_param(chat) == responses


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}]}, "input[0].arguments"),
])
def test_refused_or_malformed_fields_name_themselves(body, param):
    with pytest.raises(Exception) as e:
        ResponsesRequest.model_validate(body)
    error = to_api_error(e.value)
    assert isinstance(error, InvalidRequestError) and error.param == param, error.envelope()


def test_documented_no_ops_are_accepted():
    req = ResponsesRequest.model_validate({
        "input": "x", "user": "u", "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "k",
        "stream_options": {"include_obfuscation": False}, "text": {"verbosity": "low"}, "reasoning": None,
        "include": [], "truncation": "disabled", "background": False, "metadata": {"a": "b"}})
    assert req.metadata == {"a": "b"} and req.store is True and req.text_format.type == "text"

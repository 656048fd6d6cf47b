"""Tool calling through the real server: the OpenAI SDK's agent loop (call, tool result,
answer), LangChain's `bind_tools`, forced calls that validate against their schemas, and
streamed tool-call deltas that add up to the non-streamed call."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                           "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _assert_valid_calls(message) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_required_call_validates(client, model_name, temperature):
    r = client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, temperature=temperature, seed=1, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        _assert_valid_calls(choice.message)


def test_parallel_required_calls_each_validate(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=1.0, seed=4)
    choice = r.choices[0]
    # Every complete call validates; with max_tokens reached the last one may be cut.
    complete = choice.message.tool_calls if choice.finish_reason == "tool_calls" else choice.message.tool_calls[:-1]
    for call in complete:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function_is_called(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=80, temperature=0)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["add"]
    _assert_valid_calls(message)


def test_auto_answers_with_text_or_parsed_calls(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        assert "<tool_call>" not in (choice.message.content or "")
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_strict_tool_under_auto_is_constrained_once_called(client, model_name):
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    messages = [{"role": "user", "content": "Call get_weather for Paris."}]
    r = client.chat.completions.create(
        model=model_name, messages=messages, tools=[strict], max_tokens=80, temperature=1.0, seed=0, n=2)
    for choice in r.choices:
        if choice.message.tool_calls:  # free text is allowed; a call, once started, is constrained
            complete = choice.message.tool_calls if choice.finish_reason == "tool_calls" else choice.message.tool_calls[:-1]
            for call in complete:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_none_leaves_tools_out(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_deltas_equal_the_call(client, model_name, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=model_name, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert call["id"] is None, "the id comes once, first"
                    call["id"] = d.id
                    call["name"] = d.function.name
                else:
                    assert call["id"] is not None and not d.function.name, "name and id before the arguments"
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls]


def test_two_turn_conversation_with_the_openai_sdk(client, model_name, server_url):
    first = client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=120, temperature=0)
    assistant = first.choices[0].message
    call = assistant.tool_calls[0]
    result = json.dumps({"temperature": 21, "sky": "sunny"})
    history = ASK + [assistant.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = client.chat.completions.create(model=model_name, messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The call and its result reached the prompt.
    r = httpx.post(f"{server_url}/tokenize", json={"model": model_name, "messages": history}, timeout=30)
    assert r.status_code == 200, r.text
    prompt = httpx.post(f"{server_url}/detokenize", json={"model": model_name, "tokens": r.json()["tokens"]},
                        timeout=30).json()["prompt"]
    assert call.function.arguments in prompt and result in prompt


def test_langchain_bind_tools_round_trip(server_url, model_name):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(model=model_name, base_url=f"{server_url}/v1", api_key="x", temperature=0, max_tokens=80,
                     max_retries=0)
    bound = llm.bind_tools([add], tool_choice="add")
    messages = [HumanMessage("What is 2 plus 3?")]
    ai = bound.invoke(messages)
    assert [c["name"] for c in ai.tool_calls] == ["add"]
    args = ai.tool_calls[0]["args"]
    assert isinstance(args["a"], int) and isinstance(args["b"], int)
    messages += [ai, ToolMessage(str(add.invoke(args)), tool_call_id=ai.tool_calls[0]["id"])]
    answer = llm.bind_tools([add]).invoke(messages)
    assert isinstance(answer.content, str)


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": ASK + [{"role": "tool", "content": "21 degrees"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages"),
], ids=["unknown_tool", "tool_message_without_id", "image_part"])
def test_bad_tool_requests_are_400(server_url, model_name, helpers, body, param):
    r = httpx.post(f"{server_url}/v1/chat/completions", timeout=60,
                   json={"model": model_name, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert helpers.assert_error_envelope(r.json())["param"] == param


ADD_ASK = [{"role": "user", "content": "What is 2 plus 3?"}]


@pytest.mark.parametrize("messages", [ASK, ADD_ASK], ids=["weather", "add"])
def test_required_parallel_calls_end_at_a_repeat_not_at_max_tokens(client, model_name, messages):
    """With parallel calls on, the bundled model writes its call again and again; the repeat
    ends the list (finish_reason "tool_calls", generation stopped) instead of max_tokens."""
    kw = dict(model=model_name, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=120,
              temperature=0)
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert len(set(calls)) == len(calls)
    _assert_valid_calls(choice.message)
    assert whole.usage.completion_tokens < 120
    streamed: dict[int, list[str]] = {}
    finish = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                call = streamed.setdefault(d.index, ["", ""])
                call[0] += d.function.name or ""
                call[1] += d.function.arguments or ""
            finish += [c.finish_reason] if c.finish_reason else []
    assert finish == ["tool_calls"]
    assert [tuple(call) for _, call in sorted(streamed.items())] == calls


def test_responses_required_calls_end_at_a_repeat(client, model_name):
    add = {"type": "function", **ADD["function"]}
    kw = dict(model=model_name, input=ADD_ASK[0]["content"], tools=[add], tool_choice="required",
              max_output_tokens=120, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "completed" and r.usage.output_tokens < 120
    calls = [(o.name, o.arguments) for o in r.output if o.type == "function_call"]
    assert calls and len(set(calls)) == len(calls)
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()  # raises unless the stream ends with response.completed
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == calls

"""Request parsing without a server: structured-output specs, tools, messages, refused
and no-op fields, unknown-field logging. Each body goes through `parse_request`, the
path the server takes, so errors are the 400s a client would see."""

from __future__ import annotations

import json
import logging

import pytest

from engine.structured_output.spec import StructuredOutputSpec
from server.errors import InvalidRequestError
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    known_fields,
    structured_output_spec,
    unknown_fields,
)
from server.serving import parse_request
from server.serving_tokenize import TokenizeRequest

USER = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(json.dumps({"messages": USER, **fields}).encode(), ChatCompletionRequest)


def comp(**fields) -> CompletionRequest:
    return parse_request(json.dumps({"prompt": "Hi", **fields}).encode(), CompletionRequest)


def refused(parse, **fields) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        parse(**fields)
    assert info.value.status_code == 400
    return info.value


# ---- structured outputs ------------------------------------------------------------------------
@pytest.mark.parametrize("parse", [chat, comp])
@pytest.mark.parametrize("fields,expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputSpec.json_object("response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutputSpec.json_schema(SCHEMA, "response_format")),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputSpec.json_schema(SCHEMA, "structured_outputs")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputSpec.json_schema(SCHEMA, "structured_outputs")),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputSpec.regex("[0-9]+", "structured_outputs")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputSpec.choice(["yes", "no"], "structured_outputs")),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, StructuredOutputSpec.grammar("start: \"a\"", "structured_outputs")),
    ({"structured_outputs": {"json_object": True, "disable_fallback": True}},
     StructuredOutputSpec.json_object("structured_outputs")),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "guidance"}, StructuredOutputSpec.json_schema(SCHEMA, "guided_json")),
    ({"guided_regex": "a|b"}, StructuredOutputSpec.regex("a|b", "guided_regex")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputSpec.choice(["a", "b"], "guided_choice")),
    ({"guided_grammar": "root ::= \"a\""}, StructuredOutputSpec.grammar("root ::= \"a\"", "guided_grammar")),
    # "text" is no constraint, so it does not conflict with one
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, StructuredOutputSpec.regex("a", "guided_regex")),
])
def test_structured_output_spec(parse, fields, expected):
    spec = structured_output_spec(parse(**fields))
    assert spec == expected
    if spec is not None:
        assert spec.param == expected.param


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "a", "schema": SCHEMA}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a", "guided_grammar": "root ::= \"a\""}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "lark": "x"}}, "structured_outputs.lark"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"json": "{oops"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "  "}, "guided_grammar"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " ", "guided_json": SCHEMA}, "guided_whitespace_pattern"),
    ({"structural_tag": "{}"}, "structural_tag"),
])
def test_structured_output_refusals(fields, param):
    err = refused(chat, **fields)
    assert err.param == param, err.message
    if fields.get("response_format", {}).get("type") == "xml":
        assert "'json_schema'" in err.message  # the message lists the allowed types


# ---- tools ---------------------------------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                         "parameters": {"type": "object"}, "strict": True}}
OTHER = {"type": "function", "function": {"name": "get-time"}}


def test_tools_and_choice():
    req = chat(tools=[TOOL, OTHER], tool_choice={"type": "function", "function": {"name": "get-time"}},
               parallel_tool_calls=False)
    assert [t.function.name for t in req.effective_tools] == ["get_weather", "get-time"]
    assert req.effective_tool_choice == NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get-time"}})
    assert req.effective_parallel_tool_calls is False
    assert req.tools_for_template() == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                          "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "get-time"}},
    ]


@pytest.mark.parametrize("fields,choice", [
    ({}, "none"),
    ({"tool_choice": "auto"}, "none"),  # no tools: nothing to choose
    ({"tools": [TOOL]}, "auto"),
    ({"tools": []}, "none"),
    ({"tools": [TOOL], "tool_choice": "required"}, "required"),
    ({"tools": [TOOL], "tool_choice": "none"}, "none"),
    ({"functions": [TOOL["function"]]}, "auto"),
    ({"functions": [TOOL["function"]], "function_call": "none"}, "none"),
    ({"functions": [TOOL["function"]], "function_call": {"name": "get_weather"}}, "get_weather"),
    ({"tools": [TOOL], "function_call": {"name": "get_weather"}}, "get_weather"),
])
def test_effective_tool_choice(fields, choice):
    req = chat(**fields)
    got = req.effective_tool_choice
    assert (got.function.name if isinstance(got, NamedToolChoice) else got) == choice
    assert req.effective_parallel_tool_calls is True
    if "functions" in fields:
        assert [t.function.name for t in req.effective_tools] == ["get_weather"]


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [TOOL], "functions": [OTHER["function"]]}, "functions"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "any"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice"),
    ({"functions": [TOOL["function"]], "function_call": {"name": "nope"}}, "function_call"),
    ({"functions": [TOOL["function"]], "function_call": "auto", "tool_choice": "auto"}, "function_call"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_tool_refusals(fields, param):
    err = refused(chat, **fields)
    assert err.param == param, err.message


# ---- messages --------------------------------------------------------------------------------
def test_tool_history_for_template():
    req = chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}},
        {"role": "function", "name": "get_weather", "content": "19 C"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
        {"role": "assistant", "content": None, "refusal": "No."},
    ])
    assert [m.for_template() for m in req.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "19 C", "name": "get_weather"},
        {"role": "assistant", "content": "I cannot."},
        {"role": "assistant", "content": "No."},
    ]


@pytest.mark.parametrize("messages,says", [
    ([*USER, {"role": "tool", "content": "42"}], "messages[1]: a 'tool' message needs 'tool_call_id'"),
    ([{"role": "tool", "tool_call_id": "c", "content": None}], "messages[0]: a 'tool' message needs content"),
    ([{"role": "function", "content": "42"}], "messages[0]: a 'function' message needs 'name'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
     "messages[0].content[0]: content parts of type 'image_url' are not supported: this model takes text only"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}]}],
     "messages[0].content[1]: content parts of type 'input_audio'"),
    ([{"role": "user", "content": [{"type": "file", "file": {}}]}], "content parts of type 'file'"),
    ([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}], "content parts of type 'refusal'"),
    ([{"role": "user", "content": [{"type": "text"}]}], "a text content part needs 'text'"),
    ([{"role": "user", "content": "a", "tool_calls": []}], "only assistant messages have tool_calls"),
    ([{"role": "user", "content": "a", "tool_call_id": "c"}], "only 'tool' messages have tool_call_id"),
    ([{"role": "assistant", "content": "a", "audio": {"id": "x"}}], "audio is not supported"),
])
def test_message_refusals(messages, says):
    for parse in (lambda: chat(messages=messages),
                  lambda: parse_request(json.dumps({"messages": messages}).encode(), TokenizeRequest)):
        with pytest.raises(InvalidRequestError) as info:
            parse()
        assert info.value.param == "messages"
        assert says in info.value.message


def test_assistant_tool_call_must_be_a_function_call():
    err = refused(chat, messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "custom", "custom": {"name": "x", "input": "y"}}]}])
    assert err.param.startswith("messages[0].tool_calls[0]"), err.param


# ---- no-op, refused and unknown fields ---------------------------------------------------------------
NOOPS = dict(user="u", store=True, metadata={"k": "v"}, service_tier="flex", reasoning_effort="high",
             verbosity="medium", prompt_cache_key="key", prompt_cache_retention="in-memory",
             safety_identifier="hash", modalities=["text"])


@pytest.mark.parametrize("parse", [chat, comp])
def test_noop_fields_accepted(parse):
    req = parse(**NOOPS)
    assert structured_output_spec(req) is None


@pytest.mark.parametrize("parse,fields,param", [
    (chat, {"audio": {"voice": "alloy"}}, "audio"),
    (comp, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (chat, {"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
    (chat, {"modalities": ["audio"]}, "modalities"),
    (chat, {"modalities": []}, "modalities"),
    (chat, {"metadata": {"k": 1}}, "metadata.k"),
    (chat, {"service_tier": "gold"}, "service_tier"),
    (chat, {"best_of": 2}, "best_of"),
    (chat, {"echo": 1}, "echo"),  # strict: 1 is not true
    (chat, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM: not streamed
    (comp, {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    (comp, {"prompt_logprobs": -2}, "prompt_logprobs"),
    (chat, {"top_logprobs": -2, "logprobs": True}, "top_logprobs"),
    (comp, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (chat, {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    (comp, {"return_token_ids": "yes"}, "return_token_ids"),
    (chat, {"chat_template": "{{ messages }}"}, "chat_template"),
    (comp, {"tools": [TOOL]}, "tools"),
    (comp, {"tool_choice": "none"}, "tool_choice"),
    (comp, {"functions": []}, "functions"),
    (comp, {"function_call": "auto"}, "function_call"),
    (comp, {"parallel_tool_calls": True}, "parallel_tool_calls"),
    (comp, {"messages": USER}, "messages"),
    (comp, {"max_completion_tokens": 4}, "max_completion_tokens"),
    (comp, {"use_beam_search": 1}, "use_beam_search"),  # strict: 1 is not true
    (comp, {"priority": 5000}, "priority"),  # outside [-1000, 1000]
    (comp, {"suffix": "end"}, "suffix"),
    (comp, {"best_of": 2, "n": 3}, "best_of"),
    (comp, {"best_of": 2, "stream": True}, "best_of"),
    (comp, {"best_of": 0}, "best_of"),
])
def test_refused_fields(parse, fields, param):
    err = refused(parse, **fields)
    assert err.param == param, err.message


@pytest.mark.parametrize("parse,fields", [
    # vLLM extensions holding vLLM's default are not "used"
    (chat, {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "priority": 0, "best_of": 1,
            "echo": False, "add_special_tokens": False, "spaces_between_special_tokens": True}),
    (comp, {"use_beam_search": False, "add_special_tokens": True, "add_generation_prompt": True, "audio": None}),
    # best_of equal to n streams like plain n
    (comp, {"best_of": 2, "n": 2, "stream": True}),
])
def test_defaults_of_refused_fields_pass(parse, fields):
    parse(**fields)


def test_best_of_samples_per_prompt():
    assert comp().samples_per_prompt == 1
    assert comp(n=2).samples_per_prompt == 2
    assert comp(n=2, best_of=5).samples_per_prompt == 5


def test_unknown_fields():
    body = {"prompt": "x", "max_tokens": 1, "frobnicate": 1, "tools": [], "guided_json": {}}
    assert unknown_fields(CompletionRequest, body) == ["frobnicate"]  # tools: refused, not unknown
    assert "schema" not in known_fields(CompletionRequest)  # nested fields are not top-level ones


def test_unknown_field_logged_once_per_model(caplog):
    name = "zz_unit_test_field"
    with caplog.at_level(logging.WARNING, logger="pagoda.server"):
        for _ in range(3):
            comp(**{name: 1})
        chat(**{name: 1})
    logged = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert logged == [f"ignoring unknown request field {name!r} (not an OpenAI or vLLM field)"] * 2

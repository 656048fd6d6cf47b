"""Unit tests of server/tools/: prompt rendering, parsers (whole and streamed), grammars.

No model forward passes; the bundled model's tokenizer is loaded once for the chat template
and for llguidance.
"""

from __future__ import annotations

import itertools
import json
import random
import re

import llguidance
import pytest
from transformers import AutoTokenizer

from server.tools import (
    DEFAULT_TOOL_PARSER,
    END,
    PART,
    TOOL_PARSERS,
    ContentDelta,
    GuardedToolCallStream,
    HermesToolParser,
    JsonValueScanner,
    Llama3JsonToolParser,
    ToolCall,
    ToolCallDelta,
    collect_deltas,
    format_hermes_call,
    get_tool_parser,
    prepare_conversation,
    template_supports_tools,
    tool_call_grammar,
    validate_tool_choice,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]},
    "strict": None}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": None, "parameters": None}}
TOOLS = [WEATHER, CLOCK]
STRICT_TOOLS = [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}, CLOCK]

# A minimal template with a tools branch, in the shape Hugging Face templates have.
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}\n"
    "{% endfor %}"
)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_path):
    return AutoTokenizer.from_pretrained(str(default_model_path))


@pytest.fixture(scope="module")
def ll_tokenizer(hf_tokenizer):
    # llguidance.hf.from_tokenizer reads this GGUF-converted tokenizer's decoder
    # (Sequence[ByteFallback, ..., ByteLevel]) as SentencePiece and takes "Ġ" for two bytes;
    # the plain ByteLevel decoder is what the engine's llguidance backend uses too.
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    spec["padding"] = spec["truncation"] = None
    decoders = (spec.get("decoder") or {}).get("decoders") or []
    spec["decoder"] = next((d for d in decoders if d["type"] == "ByteLevel"), spec["decoder"])
    return llguidance.LLTokenizer(json.dumps(spec), eos_token=hf_tokenizer.eos_token_id)


def counting_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


# --------------------------------------------------------------------------- prompts

def test_bundled_template_has_no_tools_branch(hf_tokenizer):
    assert not template_supports_tools(hf_tokenizer.chat_template)


@pytest.mark.parametrize("template, expected", [
    (TOOLS_TEMPLATE, True), (None, False), ("{{ messages }}", False), ("{{ my_tools_list }}", False),
], ids=["tools-branch", "none", "plain", "tools-inside-a-name"])
def test_template_supports_tools(template, expected):
    assert template_supports_tools(template) is expected


def test_no_tools_and_no_tool_history_leaves_messages_unchanged():
    messages = [{"role": "user", "content": "hi"}]
    conversation, tools = prepare_conversation(messages, None, supports_tools=False)
    assert conversation is messages and tools is None


HISTORY = [
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


def test_default_prompt_adds_a_first_system_message_listing_the_tools():
    conversation, tools = prepare_conversation(HISTORY[:1], TOOLS, supports_tools=False)
    assert tools is None and conversation[0]["role"] == "system"
    system = conversation[0]["content"]
    assert json.dumps(CLOCK["function"]["name"]) in system and "null" not in system
    tools_block = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in tools_block] == ["get_weather", "get_time"]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system


def test_default_prompt_goes_in_front_of_an_existing_system_message():
    messages = [{"role": "system", "content": "Be brief."}, *HISTORY[:1]]
    conversation, _ = prepare_conversation(messages, TOOLS, supports_tools=False)
    assert len(conversation) == 2
    assert conversation[0]["content"].startswith("You can call functions")
    assert conversation[0]["content"].endswith("</tool_response>; use them to answer.\n"
                                               "If no tool is needed, answer the user directly.\n\nBe brief.")


def test_default_history_writes_calls_as_tool_call_blocks():
    conversation, _ = prepare_conversation(HISTORY, TOOLS, supports_tools=False)
    assert conversation[2] == {"role": "assistant", "content": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": "not json"}\n</tool_call>')}


def test_default_history_merges_consecutive_tool_messages_into_one_user_message():
    conversation, _ = prepare_conversation(HISTORY, TOOLS, supports_tools=False)
    assert len(conversation) == 4
    assert conversation[3] == {"role": "user", "content": (
        "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>")}


def test_tool_history_without_tools_is_rendered_without_a_system_block():
    conversation, _ = prepare_conversation(HISTORY, None, supports_tools=False)
    assert [m["role"] for m in conversation] == ["user", "assistant", "user"]


def test_default_conversation_renders_with_the_bundled_template(hf_tokenizer):
    conversation, tools = prepare_conversation(HISTORY, TOOLS, supports_tools=False)
    text = hf_tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou can call functions")
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_history_calls_parse_back_with_the_default_parser():
    block = format_hermes_call("get_weather", '{"city": "Paris"}')
    call = HermesToolParser().parse(block).calls[0]
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')


def test_tools_template_gets_dict_arguments_and_plain_tool_messages():
    conversation, tools = prepare_conversation(HISTORY, TOOLS, supports_tools=True)
    assert tools == TOOLS
    calls = conversation[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"city": "Paris"}
    assert calls[1]["function"]["arguments"] == "not json"
    assert conversation[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}


def test_tools_template_renders_the_prepared_conversation(hf_tokenizer):
    conversation, tools = prepare_conversation(HISTORY, TOOLS, supports_tools=True)
    text = hf_tokenizer.apply_chat_template(conversation, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=False)
    assert text.startswith("TOOLS:get_weather;get_time;")
    assert "[get_weather Paris]" in text and "tool: 12:00" in text


# --------------------------------------------------------------------------- parsers

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'

HERMES_CASES = {
    "plain-text": ("The weather is nice.\n", "The weather is nice.\n", []),
    "preamble-and-call": ("Sure.\n" + CALL_A, "Sure.", [("get_weather", '{"city": "Paris", "unit": "C"}')]),
    "two-calls": (CALL_A + "\n" + CALL_B + "\n", None,
                  [("get_weather", '{"city": "Paris", "unit": "C"}'), ("get_time", "{}")]),
    "tricky-strings": ('<tool_call>\n{"name": "echo", "arguments": {"s": "a \\"}\\" </tool_call> é{["}}\n</tool_call>',
                       None, [("echo", '{"s": "a \\"}\\" </tool_call> é{["}')]),
    "not-json-block": ("A <tool_call>\nnot json\n</tool_call> B", "A <tool_call>\nnot json\n</tool_call> B", []),
    "object-that-is-not-a-call": ('<tool_call>{"nam": 1}</tool_call>', '<tool_call>{"nam": 1}</tool_call>', []),
    "arguments-before-name": ('<tool_call>\n{"arguments": {"x": [1, "}"]}, "name": "f"}\n</tool_call>',
                              None, [("f", '{"x": [1, "}"]}')]),
    "name-only": ('<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", "{}")]),
    "missing-last-brace": ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', None, [("f", '{"a": 1}')]),
    "extra-key": ('<tool_call>\n{"name": "f", "arguments": {"a": 1}, "id": 7}\n</tool_call>', None, [("f", '{"a": 1}')]),
    "scalar-arguments": ('<tool_call>{"name": "f", "arguments": 42}</tool_call>', None, [("f", "42")]),
    "cut-in-arguments": ('<tool_call>\n{"name": "f", "arguments": {"a": "Par', None, [("f", '{"a": "Par')]),
    "cut-after-name": ('Ok <tool_call>\n{"name": "f", "argu', "Ok", [("f", "")]),
    "cut-closing-tag": ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool', None, [("f", "{}")]),
    "no-closing-tag-between-calls": (CALL_A[:-len("</tool_call>")] + CALL_B, None,
                                     [("get_weather", '{"city": "Paris", "unit": "C"}'), ("get_time", "{}")]),
    "text-after-call": (CALL_B + "\nDone.  ", "Done.  ", [("get_time", "{}")]),
    "tag-lookalikes": ("a <tool_cal b <<tool_call> c <tool", "a <tool_cal b <<tool_call> c <tool", []),
    "double-angle-then-call": ("x <" + CALL_B, "x <", [("get_time", "{}")]),
}

LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_CASES = {
    "plain-text": ("  Paris is sunny.", "  Paris is sunny.", []),
    "python-tag-call": ("<|python_tag|>" + LLAMA_CALL, None, [("get_weather", '{"city": "Paris"}')]),
    "two-calls": (LLAMA_CALL + '; {"name": "get_time", "arguments": {}}', None,
                  [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    "json-answer": ('{"answer": 42}', '{"answer": 42}', []),
    "text-then-json": ("Here: " + LLAMA_CALL, "Here: " + LLAMA_CALL, []),
    "trailing-text": (LLAMA_CALL + " Done.", " Done.", [("get_weather", '{"city": "Paris"}')]),
    "second-object-not-a-call": (LLAMA_CALL + '; {"x": 1}', '; {"x": 1}', [("get_weather", '{"city": "Paris"}')]),
    "cut-in-arguments": ('\n{"name": "f", "parameters": {"a": [1, ', None, [("f", '{"a": [1, ')]),
}

PARSER_CASES = [(HermesToolParser, text, content, calls, f"hermes-{case}")
                for case, (text, content, calls) in HERMES_CASES.items()]
PARSER_CASES += [(Llama3JsonToolParser, text, content, calls, f"llama3-{case}")
                 for case, (text, content, calls) in LLAMA3_CASES.items()]


@pytest.mark.parametrize("parser_class, text, content, calls",
                         [case[:4] for case in PARSER_CASES], ids=[case[4] for case in PARSER_CASES])
def test_parse(parser_class, text, content, calls):
    parsed = parser_class().parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls


def split_runs(text: str, seed: int):
    """Every split into two deltas, one delta per character, and random chunkings."""
    yield from ([text[:i], text[i:]] for i in range(len(text) + 1))
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("parser_class, text", [case[:2] for case in PARSER_CASES],
                         ids=[case[4] for case in PARSER_CASES])
def test_streaming_adds_up_to_parse_for_any_split(parser_class, text):
    parsed = parser_class().parse(text)
    for chunks in split_runs(text, seed=len(text)):
        stream = parser_class(counting_ids()).streaming()
        deltas = [d for chunk in chunks for d in stream.feed(chunk)] + stream.finish()
        streamed = collect_deltas(deltas)
        assert streamed.content == parsed.content, chunks
        assert [(c.name, c.arguments) for c in streamed.calls] == [(c.name, c.arguments) for c in parsed.calls], chunks
        assert [c.id for c in streamed.calls] == [f"call_{i}" for i in range(len(parsed.calls))]


@pytest.mark.parametrize("parser_class, text", [case[:2] for case in PARSER_CASES],
                         ids=[case[4] for case in PARSER_CASES])
def test_a_call_streams_id_and_name_first_then_only_arguments(parser_class, text):
    stream = parser_class(counting_ids()).streaming()
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    seen: set[int] = set()
    for d in (d for d in deltas if isinstance(d, ToolCallDelta)):
        if d.index not in seen:
            assert d.id and d.name and d.arguments == ""
        else:
            assert d.id is None and d.name is None and d.arguments
        seen.add(d.index)
    assert seen == set(range(len(seen)))


def test_name_and_arguments_stream_before_the_call_is_complete():
    stream = HermesToolParser(counting_ids()).streaming()
    deltas = stream.feed('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert deltas == [ContentDelta("Sure."), ToolCallDelta(0, "", "call_0", "get_weather"), ToolCallDelta(0, '{"ci')]


def test_text_that_may_start_a_tag_is_held_back_until_it_cannot():
    stream = HermesToolParser().streaming()
    assert stream.feed("Hi <tool") == [ContentDelta("Hi")]
    assert stream.feed("s are great") == [ContentDelta(" <tools are great")]


def test_a_top_level_number_is_held_until_it_ends():
    stream = HermesToolParser(counting_ids()).streaming()
    assert stream.feed('<tool_call>{"name": "f", "arguments": 12') == [ToolCallDelta(0, "", "call_0", "f")]
    assert stream.feed("3}") == [ToolCallDelta(0, "123")]


def test_default_ids_are_openai_style_and_injectable():
    assert re.fullmatch(r"call_[0-9a-f]{24}", HermesToolParser().parse(CALL_B).calls[0].id)
    parsed = HermesToolParser(counting_ids()).parse(CALL_A + CALL_B)
    assert [c.id for c in parsed.calls] == ["call_0", "call_1"]


def test_registry_has_the_default_parser():
    assert get_tool_parser(DEFAULT_TOOL_PARSER) is HermesToolParser
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="available: " + ", ".join(sorted(TOOL_PARSERS))):
        get_tool_parser("mistral")


@pytest.mark.parametrize("text, value", [
    ('  {"a": "}"} rest', '{"a": "}"}'), ('"x\\"y" z', '"x\\"y"'), ("123, ", "123"), ("[1, [2]]x", "[1, [2]]"),
    ("true}", "true"), ('{"a": 1 </tool_call>', '{"a": 1 '), ("-1.5e3", "-1.5e3"),
], ids=["object", "escaped-string", "number", "nested-array", "literal", "cut-by-tag", "number-at-end"])
def test_json_value_scanner_finds_the_end_of_a_value(text, value):
    scanner, scanned = JsonValueScanner(), ""
    for ch in text:
        step = scanner.push(ch)
        if step == END:
            break
        scanned += ch if step == PART else ""
    assert scanned == value


# --------------------------------------------------------------------------- grammars

def accepts(ll_tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    return matcher.consume_tokens(ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


def hermes(name: str, arguments: dict) -> str:
    return format_hermes_call(name, json.dumps(arguments))


def llama(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "parameters": arguments})


PARIS = {"city": "Paris"}
# (parser, tools, tool_choice, parallel, accepted texts, rejected texts)
GRAMMAR_CASES = {
    "hermes-required": ("hermes", TOOLS, "required", False,
                        [hermes("get_weather", {"city": "Paris", "unit": "F"}), hermes("get_time", {})],
                        [hermes("get_wether", PARIS), hermes("get_weather", {"unit": "C"}), "Hello",
                         hermes("get_time", {}) + "\n" + hermes("get_time", {})]),
    "hermes-required-parallel": ("hermes", TOOLS, "required", True,
                                 [hermes("get_weather", PARIS) + "\n" + hermes("get_time", {"tz": "UTC"})],
                                 [hermes("get_weather", PARIS) + "\n" + hermes("get_weather", {})]),
    "hermes-named": ("hermes", TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True,
                     [hermes("get_weather", PARIS)], [hermes("get_time", {}), "Sure. " + hermes("get_weather", PARIS)]),
    "hermes-auto-strict": ("hermes", STRICT_TOOLS, "auto", True,
                           ["Paris is sunny.", "", "Sure.\n" + hermes("get_weather", PARIS),
                            hermes("get_weather", PARIS) + "\n" + hermes("get_time", {})],
                           ["Sure.\n<tool_call>\nI think", "Sure.\n" + hermes("get_weather", {}),
                            hermes("get_weather", PARIS) + " bye"]),
    "llama3-required": ("llama3_json", TOOLS, "required", True,
                        [llama("get_weather", PARIS) + "; " + llama("get_time", {})],
                        [llama("get_wether", PARIS), llama("get_weather", {"unit": "C"})]),
    "llama3-auto-strict": ("llama3_json", STRICT_TOOLS, "auto", False, ["Paris is sunny.", llama("get_weather", PARIS)],
                           [llama("get_weather", {}), ' {"name"']),
}


@pytest.mark.parametrize("case", GRAMMAR_CASES.values(), ids=GRAMMAR_CASES.keys())
def test_grammar_is_valid_for_llguidance(case, ll_tokenizer):
    parser_name, tools, tool_choice, parallel, _, _ = case
    grammar = tool_call_grammar(tools, tool_choice, parallel, parser_name)
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""


@pytest.mark.parametrize("case", GRAMMAR_CASES.values(), ids=GRAMMAR_CASES.keys())
def test_grammar_accepts_valid_output_that_parses_into_calls(case, ll_tokenizer):
    parser_name, tools, tool_choice, parallel, valid, _ = case
    grammar = tool_call_grammar(tools, tool_choice, parallel, parser_name)
    for text in valid:
        assert accepts(ll_tokenizer, grammar, text), text
        parsed = get_tool_parser(parser_name)().parse(text)
        if "{" in text:  # a call: nothing but the text before it is left as content
            assert parsed.calls and parsed.content in (None, text.split("\n<tool_call>")[0])


@pytest.mark.parametrize("case", GRAMMAR_CASES.values(), ids=GRAMMAR_CASES.keys())
def test_grammar_rejects_invalid_calls(case, ll_tokenizer):
    parser_name, tools, tool_choice, parallel, _, invalid = case
    grammar = tool_call_grammar(tools, tool_choice, parallel, parser_name)
    for text in invalid:
        assert not accepts(ll_tokenizer, grammar, text), text


def test_required_grammar_output_parses_with_no_leftover_content():
    text = hermes("get_weather", PARIS) + "\n" + hermes("get_time", {})
    parsed = HermesToolParser().parse(text)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", PARIS), ("get_time", {})]


def test_grammar_resolves_local_refs_of_each_tool(ll_tokenizer):
    point = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
             "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    tools = [{"type": "function", "function": {"name": name, "parameters": point}} for name in ("a", "b")]
    grammar = tool_call_grammar(tools, "required", False, "hermes")
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""
    assert accepts(ll_tokenizer, grammar, hermes("b", {"p": {"x": 1}}))
    assert not accepts(ll_tokenizer, grammar, hermes("b", {"p": {"x": "one"}}))


def test_special_token_tags_are_written_as_tokens():
    grammar = tool_call_grammar(STRICT_TOOLS, "auto", True, "hermes", special_tokens={"<tool_call>", "</tool_call>"})
    assert "start: TEXT | TEXT call" in grammar and '"\\n" </tool_call>' in grammar and "lazy" not in grammar


@pytest.mark.parametrize("tools, tool_choice", [
    (TOOLS, "none"), (TOOLS, "auto"), (TOOLS, None), (STRICT_TOOLS, "none"), (None, "required"),
], ids=["none", "auto-not-strict", "unset", "none-strict", "no-tools"])
def test_no_grammar_when_nothing_is_forced(tools, tool_choice):
    assert tool_call_grammar(tools, tool_choice, True, "hermes") is None


# --------------------------------------------------------------------------- tool_choice

@pytest.mark.parametrize("tools, tool_choice, message", [
    (TOOLS, {"type": "function", "function": {"name": "get_wether"}}, "'get_wether'.*get_weather, get_time"),
    (None, "auto", "only allowed when tools are specified"),
    ([], {"type": "function", "function": {"name": "get_weather"}}, "only allowed when tools"),
    (TOOLS, {"type": "function", "function": {}}, "must look like"),
    (TOOLS, "sometimes", "must be 'none', 'auto', 'required'"),
], ids=["unknown-function", "no-tools", "empty-tools", "no-name", "bad-string"])
def test_invalid_tool_choice_is_rejected(tools, tool_choice, message):
    with pytest.raises(ValueError, match=message):
        validate_tool_choice(tools, tool_choice)


@pytest.mark.parametrize("tools, tool_choice", [
    (TOOLS, "auto"), (TOOLS, "required"), (TOOLS, "none"), (None, None),
    (TOOLS, {"type": "function", "function": {"name": "get_time"}}),
], ids=["auto", "required", "none", "unset", "named"])
def test_valid_tool_choice_passes(tools, tool_choice):
    validate_tool_choice(tools, tool_choice)


def test_tool_call_is_a_plain_value():
    assert ToolCall("f", "{}", "call_1") == ToolCall("f", "{}", "call_1")


# --------------------------------------------------------------------------- the duplicate-call guard

def guarded(text: str, max_calls: int = 16, chunks=None):
    """(calls, content, ended) of `text` through the guard, fed whole or in `chunks`."""
    stream = GuardedToolCallStream(HermesToolParser(counting_ids()).streaming(), max_calls)
    deltas = [d for chunk in (chunks or [text]) for d in stream.feed(chunk)] + stream.finish()
    parsed = collect_deltas(deltas)
    return [(c.name, c.arguments) for c in parsed.calls], parsed.content, stream.ended


PARIS_C = hermes("get_weather", {"city": "Paris", "unit": "C"})
PARIS_F = hermes("get_weather", {"city": "Paris", "unit": "F"})
PARIS_C_MORE = hermes("get_weather", {"city": "Paris", "unit": "C", "days": 2})
TIME = hermes("get_time", {})


@pytest.mark.parametrize("blocks, emitted, ended", [
    ([PARIS_C, PARIS_F, PARIS_C, TIME], [PARIS_C, PARIS_F], True),
    ([TIME, TIME], [TIME], True),
    ([PARIS_C, PARIS_F, TIME], [PARIS_C, PARIS_F, TIME], False),
    ([PARIS_C, PARIS_C_MORE], [PARIS_C, PARIS_C_MORE], False),
], ids=["third-repeats-first", "second-repeats-first", "no-repeat", "arguments-extending-an-earlier-call"])
def test_a_repeated_call_ends_the_list_unemitted(blocks, emitted, ended):
    expected = [(c.name, c.arguments) for block in emitted for c in HermesToolParser().parse(block).calls]
    calls, _, guard_ended = guarded("\n".join(blocks))
    assert (calls, guard_ended) == (expected, ended)


def test_the_guard_holds_a_possible_repeat_back_for_any_split():
    text = PARIS_C + "\n" + PARIS_F + "\n" + PARIS_C + "\n" + TIME
    whole = guarded(text)
    for chunks in split_runs(text, seed=7):
        assert guarded(text, chunks=chunks) == whole, chunks
    # Streamed a character at a time, the repeat's name never goes out.
    stream = GuardedToolCallStream(HermesToolParser(counting_ids()).streaming(), 16)
    names = [d.name for ch in text for d in stream.feed(ch) if isinstance(d, ToolCallDelta) and d.name]
    assert names == ["get_weather", "get_weather"] and stream.ended


def test_calls_past_the_cap_end_the_list():
    text = "\n".join(hermes("get_weather", {"city": city}) for city in ("A", "B", "C"))
    calls, _, ended = guarded(text, max_calls=2)
    assert [json.loads(arguments)["city"] for _, arguments in calls] == ["A", "B"] and ended
    assert guarded(text, max_calls=3)[2] is False


def test_a_held_call_cut_short_stands_as_written():
    calls, _, ended = guarded(PARIS_C + "\n" + PARIS_C[:-len('"}}\n</tool_call>')])
    assert [name for name, _ in calls] == ["get_weather", "get_weather"] and not ended
    assert calls[1][1] == '{"city": "Paris", "unit": "C'


def test_text_after_the_list_ended_is_dropped():
    calls, content, ended = guarded("Sure.\n" + TIME + "\n" + TIME + "\nDone.")
    assert (len(calls), content, ended) == (1, "Sure.", True)

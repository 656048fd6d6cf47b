"""Reasoning models through the real server: a tiny Qwen3 with Qwen3's chat template and
think tokens, scripted to think " ok so well" and answer " The answer" (tests/tiny_models.py
THINKING_SCRIPT), its reasoning parser chosen from the template (`--reasoning-parser auto`).
The thinking is kept out of `content` (chat) and the message item (Responses), streamed
before the answer, switched off per request, bounded by a budget, and a response format
constrains the answer only."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

THINKING, ANSWER = " ok so well", " The answer"
NUM_REASONING_TOKENS = 5  # <think>, three words, </think>
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def thinking_server(start_server, thinking_model_path):
    return start_server(["--model", str(thinking_model_path), "--served-model-name", "thinker",
                         "--kv-cache-memory", "0.02"])


@pytest.fixture(scope="module")
def thinker(thinking_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="x", max_retries=0, timeout=60)


def chat(thinker, **kw):
    return thinker.chat.completions.create(**{"model": "thinker", "messages": HI, "temperature": 0, "max_tokens": 20,
                                              **kw})


def test_the_parser_is_chosen_from_the_chat_template_and_logged(thinking_server):
    assert "reasoning_parser: qwen3 (from the chat template" in thinking_server.log_path.read_text(errors="replace")


def test_chat_reasoning_apart_from_the_content(thinker):
    r = chat(thinker)
    message = r.choices[0].message
    # The official SDK keeps fields it does not know in model_extra.
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == THINKING
    assert message.content == ANSWER
    assert r.usage.completion_tokens_details.reasoning_tokens == NUM_REASONING_TOKENS
    assert r.usage.completion_tokens == NUM_REASONING_TOKENS + 3  # " The", " answer", <|im_end|>


def test_streamed_reasoning_comes_first_and_equals_the_whole(thinker):
    chunks = list(chat(thinker, stream=True, stream_options={"include_usage": True}))
    kinds, reasoning, content = [], "", ""
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            if thinking := (delta.model_extra or {}).get("reasoning_content"):
                assert delta.model_extra["reasoning"] == thinking
                reasoning += thinking
                kinds.append("reasoning")
            if delta.content:
                assert "<think>" not in delta.content and "</think>" not in delta.content
                content += delta.content
                kinds.append("content")
    assert (reasoning, content) == (THINKING, ANSWER)
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning"), kinds  # all reasoning before any content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == NUM_REASONING_TOKENS


@pytest.mark.parametrize("switch", [
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"reasoning_effort": "none"},
], ids=["enable_thinking", "reasoning_effort"])
def test_thinking_switched_off_per_request(thinking_server, switch):
    r = httpx.post(f"{thinking_server.url}/v1/chat/completions", timeout=60,
                   json={"messages": HI, "temperature": 0, "max_tokens": 20, **switch})
    assert r.status_code == 200, r.text
    body = r.json()
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message and "reasoning" not in message
    assert message["content"] == ANSWER
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_a_json_schema_constrains_the_answer_after_the_thinking(thinker):
    schema = {"type": "object", "properties": {"a": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["a"], "additionalProperties": False}
    r = chat(thinker, max_tokens=40, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == THINKING  # free text: no JSON in the thinking
    assert json.loads(message.content)["a"] in ("yes", "no")
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("field, budget", [("thinking_token_budget", 0), ("thinking_token_budget", 1),
                                           ("max_reasoning_tokens", 2)])
def test_the_budget_closes_the_thinking_after_exactly_that_many_tokens(thinker, thinking_model_path, field, budget):
    tokenizer = AutoTokenizer.from_pretrained(thinking_model_path)
    r = chat(thinker, extra_body={field: budget, "return_token_ids": True})
    choice = r.choices[0]
    tokens = tokenizer.convert_ids_to_tokens(choice.model_extra["token_ids"])
    assert tokens[: budget + 2] == ["<think>", *["Ġok", "Ġso", "Ġwell"][:budget], "</think>"]
    assert choice.message.model_extra["reasoning_content"] == "".join([" ok", " so", " well"][:budget])
    assert choice.message.content == ANSWER  # the script goes on from </think>
    assert r.usage.completion_tokens_details.reasoning_tokens == budget + 2


def test_max_tokens_still_bounds_thinking_and_answer(thinker):
    r = chat(thinker, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.model_extra["reasoning_content"] == " ok so" and r.choices[0].message.content == ""


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "thinking_token_budget": 4}, "thinking_token_budget"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": HI, "thinking_token_budget": 1, "max_reasoning_tokens": 2},
     "max_reasoning_tokens"),
    ("/v1/responses", {"input": "Hi", "reasoning": {"summary": "detailed"}}, "reasoning.summary"),
])
def test_misused_reasoning_fields_are_refused_by_name(thinking_server, helpers, path, body, param):
    r = httpx.post(f"{thinking_server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert helpers.assert_error_envelope(r.json())["param"] == param


def test_responses_reasoning_item_before_the_message(thinker):
    r = thinker.responses.create(model="thinker", input="Hi", temperature=0, max_output_tokens=20,
                                 reasoning={"effort": "high", "summary": "auto"})
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THINKING and reasoning.summary == []
    assert message.type == "message" and r.output_text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens == NUM_REASONING_TOKENS
    # The stored conversation goes on with the reasoning item in it (Qwen3's template drops it).
    follow = thinker.responses.create(model="thinker", input="Again", previous_response_id=r.id, temperature=0,
                                      max_output_tokens=20)
    assert follow.output_text == ANSWER


def test_responses_stream_events_for_the_reasoning_item(thinker):
    events = list(thinker.responses.create(model="thinker", input="Hi", temperature=0, max_output_tokens=20,
                                           stream=True))
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.done") < first_text
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THINKING
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["reasoning", "message"]
    assert events[-1].type == "response.completed"
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


def test_a_model_without_a_reasoning_format_has_no_reasoning_fields(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=HI, max_tokens=2)
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert r.usage.completion_tokens_details is None


# ---- Anthropic's Messages API: thinking blocks ---------------------------------------------------
@pytest.fixture(scope="module")
def claude(thinking_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=thinking_server.url, api_key="x", max_retries=0, timeout=60)


THINK = {"type": "enabled", "budget_tokens": 1024}


def test_messages_thinking_block_before_the_answer(claude):
    m = claude.messages.create(model="thinker", max_tokens=2048, extra_body={"temperature": 0}, messages=HI, thinking=THINK)
    thinking, text = m.content
    assert (thinking.type, thinking.thinking) == ("thinking", THINKING) and thinking.signature
    assert (text.type, text.text) == ("text", ANSWER)
    assert m.stop_reason == "end_turn"
    assert m.usage.output_tokens == NUM_REASONING_TOKENS + 3  # thinking tokens count as output, as Anthropic's
    # Without `thinking` (Anthropic's default) the model's thinking is switched off in its template.
    m = claude.messages.create(model="thinker", max_tokens=2048, extra_body={"temperature": 0}, messages=HI)
    assert [(b.type, b.text) for b in m.content] == [("text", ANSWER)]
    assert m.usage.output_tokens == 3


def test_messages_thinking_streamed_as_anthropics_events(claude):
    with claude.messages.stream(model="thinker", max_tokens=2048, extra_body={"temperature": 0}, messages=HI,
                                thinking={"type": "adaptive"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [(e.index, e.delta.type) for e in events if e.type == "content_block_delta"]
    kinds = [kind for _, kind in deltas]
    # Thinking deltas, one signature, then the answer's text, each in its own block.
    assert kinds == sorted(kinds, key=["thinking_delta", "signature_delta", "text_delta"].index), kinds
    assert kinds.count("signature_delta") == 1
    assert {index for index, kind in deltas if kind != "text_delta"} == {0}
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == THINKING
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == ANSWER
    whole = claude.messages.create(model="thinker", max_tokens=2048, extra_body={"temperature": 0}, messages=HI,
                                   thinking={"type": "adaptive"})
    assert final.content[0].signature == whole.content[0].signature  # the same thinking, the same tag


def test_messages_thinking_omitted_and_past_thinking_blocks(claude):
    m = claude.messages.create(model="thinker", max_tokens=2048, extra_body={"temperature": 0}, messages=HI,
                               thinking={**THINK, "display": "omitted"})
    assert (m.content[0].type, m.content[0].thinking) == ("thinking", "") and m.content[0].signature
    # A client sends the reply back whole, thinking included: accepted, and left out of the prompt.
    history = [*HI, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": THINKING, "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": ANSWER}]},
               {"role": "user", "content": "Again"}]
    without = [*HI, {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Again"}]
    count = lambda messages, **kw: claude.messages.count_tokens(model="thinker", messages=messages, **kw).input_tokens  # noqa: E731
    assert count(history, thinking=THINK) == count(without, thinking=THINK)
    # Thinking off closes it in the prompt (Qwen3's template writes an empty <think></think>).
    assert count(without) > count(without, thinking=THINK)
    m = claude.messages.create(model="thinker", max_tokens=2048, extra_body={"temperature": 0}, messages=history, thinking=THINK)
    assert [b.type for b in m.content] == ["thinking", "text"]


def test_tokenize_renders_the_chat_template_kwargs_as_the_chat_route(thinking_server, helpers):
    def tokenize(**kw):
        r = httpx.post(f"{thinking_server.url}/tokenize", json={"messages": HI, **kw}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["count"]

    off = {"chat_template_kwargs": {"enable_thinking": False}}
    chat = httpx.post(f"{thinking_server.url}/v1/chat/completions", timeout=60,
                      json={"messages": HI, "max_tokens": 1, **off}).json()
    assert tokenize(**off) == chat["usage"]["prompt_tokens"] > tokenize()  # the closed <think></think>
    r = httpx.post(f"{thinking_server.url}/tokenize", json={"messages": HI, "chat_template_kwargs": {"tools": []}},
                   timeout=60)
    assert r.status_code == 400 and helpers.assert_error_envelope(r.json())["param"] == "chat_template_kwargs"

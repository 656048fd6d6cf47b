"""/tokenize and /detokenize in vLLM's and llama.cpp's forms, through the shared server
(server/serving_tokenize.py): the tokens agree with the Hugging Face tokenizer, a chat with
tools counts what the chat route prefills, and a field of the other form is a 400."""

from __future__ import annotations

import httpx
import pytest

TEXT = "Hello, naïve café 東京 <|im_start|> 12345."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_path))


def _post(server_url, path, body, status=200):
    r = httpx.post(f"{server_url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text[:300]
    return r.json()


def test_vllm_prompt_form_returns_token_strs(server_url, model_name, hf_tokenizer):
    body = _post(server_url, "/tokenize", {"model": model_name, "prompt": TEXT, "return_token_strs": True})
    ids = hf_tokenizer.encode(TEXT)
    assert body["tokens"] == ids
    assert body["count"] == len(ids)
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(ids)
    # Not asked: null, as vLLM answers.
    assert _post(server_url, "/tokenize", {"model": model_name, "prompt": TEXT})["token_strs"] is None


@pytest.mark.parametrize("tool_choice", [None, "none"])
def test_messages_with_tools_count_what_chat_prefills(client, server_url, model_name, tool_choice):
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    counted = _post(server_url, "/tokenize", {"model": model_name, "messages": MESSAGES, "tools": TOOLS, **extra})
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, tools=TOOLS, max_tokens=1,
                                          temperature=0, **extra)
    assert counted["count"] == chat.usage.prompt_tokens
    without = _post(server_url, "/tokenize", {"model": model_name, "messages": MESSAGES})["count"]
    # The tools are in the prompt unless tool_choice is "none".
    assert (counted["count"] > without + 20) if tool_choice is None else (counted["count"] == without)


def test_llamacpp_content_form(server_url, hf_tokenizer):
    body = _post(server_url, "/tokenize", {"content": TEXT})
    assert body == {"tokens": hf_tokenizer.encode(TEXT, add_special_tokens=False)}
    # parse_special false: the special token's text is tokenized as text.
    plain = _post(server_url, "/tokenize", {"content": "<|im_start|>", "parse_special": False})["tokens"]
    assert plain == hf_tokenizer.encode("<|im_start|>", add_special_tokens=False, split_special_tokens=True)
    assert len(plain) > 1
    # A mixed prompt: texts tokenized in turn, ids as they are.
    mixed = _post(server_url, "/tokenize", {"content": ["Hello", 42, " world"]})["tokens"]
    assert mixed == [*hf_tokenizer.encode("Hello", add_special_tokens=False), 42,
                     *hf_tokenizer.encode(" world", add_special_tokens=False)]


def test_llamacpp_pieces_add_up_to_the_text(server_url, hf_tokenizer):
    pieces = _post(server_url, "/tokenize", {"content": TEXT, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == hf_tokenizer.encode(TEXT, add_special_tokens=False)
    # A CJK character splits over two tokens: their pieces are bytes (lists), as llama.cpp sends them.
    assert any(isinstance(p["piece"], list) for p in pieces)
    assert "<|im_start|>" in [p["piece"] for p in pieces]
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined.decode("utf-8") == TEXT


def test_detokenize_answers_both_forms(server_url, model_name, hf_tokenizer):
    ids = hf_tokenizer.encode(TEXT, add_special_tokens=False)
    assert _post(server_url, "/detokenize", {"tokens": ids}) == {"prompt": TEXT, "content": TEXT}
    assert _post(server_url, "/detokenize", {"model": model_name, "tokens": ids})["prompt"] == TEXT


@pytest.mark.parametrize("body, param", [
    ({"content": "x", "return_token_strs": True}, "return_token_strs"),
    ({"prompt": "x", "with_pieces": True}, "with_pieces"),
    ({"prompt": "x", "tools": TOOLS}, "tools"),
    ({"messages": MESSAGES, "add_special": True}, "add_special"),
    ({"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    ({"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"content": [1, 10**9]}, "content"),
], ids=["content+token_strs", "prompt+pieces", "prompt+tools", "messages+add_special", "messages+special_tokens",
        "chat_template", "content_id_out_of_vocab"])
def test_a_field_of_another_form_is_a_400(server_url, helpers, body, param):
    r = httpx.post(f"{server_url}/tokenize", json=body, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert helpers.assert_error_envelope(r.json())["param"] == param

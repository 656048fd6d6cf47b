"""vLLM's request extensions through the real server (server/protocol_vllm.py):
`prompt_logprobs`, `return_token_ids`, `return_tokens_as_token_ids` (and its server flag),
`truncate_prompt_tokens`, `echo` on chat, `top_logprobs: -1` under `--max-logprobs`, and the
`logit_bias` / `stop_token_ids` errors that name every offending key.

The prompt logprobs are checked against the echo path's (the same engine computation,
itself checked against Hugging Face in test_echo_logprobs.py).
"""

import re

import httpx
import pytest

PROMPT = "The capital of France is Paris, and the capital of Italy is"
TOKEN_ID = re.compile(r"token_id:(\d+)")
CONTINUE = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A fruit I like is"}]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def _ok(url: str, path: str, body: dict) -> dict:
    r = _post(url, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def _refused(url: str, path: str, body: dict, param: str, helpers) -> str:
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    err = helpers.assert_error_envelope(r.json())
    assert err["param"] == param, err
    return err["message"]


def _stream(url: str, path: str, body: dict, helpers) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = helpers.parse_sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def _entry(prompt_logprobs: list, i: int, token_id: int) -> dict:
    return prompt_logprobs[i][str(token_id)]


# ---- prompt_logprobs ---------------------------------------------------------------------------------
def test_completion_prompt_logprobs_equal_the_echo_paths(server_url, helpers):
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2,
            "prompt_logprobs": 2, "return_token_ids": True}
    choice = _ok(server_url, "/v1/completions", body)["choices"][0]
    ids, vllm, echo = choice["prompt_token_ids"], choice["prompt_logprobs"], choice["logprobs"]
    assert ids == helpers.tokenize(server_url, None, PROMPT)
    assert len(vllm) == len(ids) and vllm[0] is None and echo["token_logprobs"][0] is None
    for i in range(1, len(ids)):
        own = _entry(vllm, i, ids[i])
        assert own["logprob"] == echo["token_logprobs"][i]
        assert own["decoded_token"] == echo["tokens"][i]
        # The prompt token and the 2 best: the same logprobs as the echo's top_logprobs.
        others = {t: e for t, e in vllm[i].items() if e["rank"] <= 2}
        assert sorted(e["rank"] for e in others.values()) == [1, 2]
        assert len(vllm[i]) == len(others) + (own["rank"] > 2)
        assert sorted(e["logprob"] for e in vllm[i].values()) == sorted(echo["top_logprobs"][i].values())


def test_prompt_logprobs_without_echo_and_on_chat(server_url, helpers):
    ids = helpers.tokenize(server_url, None, PROMPT)
    # Alone (no echo), with another count than the echo's: the same numbers.
    reference = _ok(server_url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 0,
                                                    "temperature": 0})["choices"][0]["logprobs"]["token_logprobs"][:len(ids)]
    out = _ok(server_url, "/v1/completions", {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 0})
    choice = out["choices"][0]
    assert choice["text"] and "logprobs" in choice and choice["logprobs"] is None
    assert [None] + [_entry(choice["prompt_logprobs"], i, ids[i])["logprob"] for i in range(1, len(ids))] \
        == pytest.approx(reference, abs=1e-5)
    assert all(len(e) == 1 for e in choice["prompt_logprobs"][1:])  # 0 alternatives: the prompt token alone

    # Chat: on the response (as vLLM), over the rendered prompt; the same numbers as the
    # completions route gives for those token ids.
    chat = _ok(server_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                    "prompt_logprobs": 1, "return_token_ids": True})
    chat_ids = chat["prompt_token_ids"]
    assert len(chat_ids) == chat["usage"]["prompt_tokens"] == len(chat["prompt_logprobs"])
    same = _ok(server_url, "/v1/completions", {"prompt": chat_ids, "max_tokens": 1, "prompt_logprobs": 1})
    for mine, theirs in zip(chat["prompt_logprobs"][1:], same["choices"][0]["prompt_logprobs"][1:]):
        assert mine.keys() == theirs.keys()
        for t in mine:
            assert mine[t]["logprob"] == pytest.approx(theirs[t]["logprob"], abs=1e-5)
            assert mine[t]["rank"] == theirs[t]["rank"]


def test_prompt_logprobs_null_unless_asked(server_url):
    comp = _ok(server_url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    chat = _ok(server_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    assert comp["choices"][0]["prompt_logprobs"] is None and chat["prompt_logprobs"] is None
    assert "token_ids" not in comp["choices"][0] and "prompt_token_ids" not in chat


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi", "stream": True, "prompt_logprobs": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "prompt_logprobs": 1}),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -1}),  # the vocabulary: past --max-logprobs
])
def test_prompt_logprobs_refused(server_url, helpers, path, body):
    _refused(server_url, path, {**body, "max_tokens": 1}, "prompt_logprobs", helpers)


# ---- return_token_ids ------------------------------------------------------------------------------------
def test_completion_token_ids_streamed_and_not(server_url, helpers):
    body = {"prompt": ["Once upon a time", "Hello"], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    whole = _ok(server_url, "/v1/completions", body)
    for choice, prompt in zip(whole["choices"], body["prompt"]):
        assert choice["prompt_token_ids"] == helpers.tokenize(server_url, None, prompt)
        assert len(choice["token_ids"]) == 6
        assert helpers.detokenize(server_url, None, choice["token_ids"]) == choice["text"]
    chunks = [c for e in _stream(server_url, "/v1/completions", body, helpers) for c in e["choices"]]
    for index, choice in enumerate(whole["choices"]):
        mine = [c for c in chunks if c["index"] == index]
        assert [c.get("prompt_token_ids") for c in mine if "prompt_token_ids" in c] == [choice["prompt_token_ids"]]
        assert "prompt_token_ids" in mine[0]
        assert [t for c in mine for t in c.get("token_ids", [])] == choice["token_ids"]
        assert all("prompt_logprobs" not in c for c in mine)


def test_chat_token_ids_streamed_and_not(server_url, helpers):
    body = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}
    whole = _ok(server_url, "/v1/chat/completions", body)
    choice = whole["choices"][0]
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    assert helpers.detokenize(server_url, None, choice["token_ids"]).startswith(choice["message"]["content"])
    events = _stream(server_url, "/v1/chat/completions", body, helpers)
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids", [])] == choice["token_ids"]


# ---- return_tokens_as_token_ids --------------------------------------------------------------------------
def test_completion_tokens_as_token_ids(server_url):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = _ok(server_url, "/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["prompt_token_ids"] + choice["token_ids"]]
    for top in lp["top_logprobs"][1:]:
        assert all(TOKEN_ID.fullmatch(key) for key in top)
    # The offsets still index the text: the last token starts where its text does.
    plain = _ok(server_url, "/v1/completions", {**body, "return_tokens_as_token_ids": False})["choices"][0]
    assert lp["text_offset"] == plain["logprobs"]["text_offset"]
    assert not any(TOKEN_ID.fullmatch(t) for t in plain["logprobs"]["tokens"])


def test_chat_tokens_as_token_ids(server_url):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = _ok(server_url, "/v1/chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    for e in content:
        assert e["bytes"] == list(e["token"].encode())
        assert all(TOKEN_ID.fullmatch(top["token"]) for top in e["top_logprobs"])


# ---- truncate_prompt_tokens ------------------------------------------------------------------------------
def test_truncate_prompt_tokens_keeps_the_last_tokens(server_url, helpers):
    ids = helpers.tokenize(server_url, None, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "return_token_ids": True}
    cut = _ok(server_url, "/v1/completions", {**body, "truncate_prompt_tokens": 5})
    choice = cut["choices"][0]
    assert cut["usage"]["prompt_tokens"] == 5 and choice["prompt_token_ids"] == ids[-5:]
    tail = helpers.detokenize(server_url, None, ids[-5:])
    assert choice["text"].startswith(tail)  # the echo shows what the model saw
    same = _ok(server_url, "/v1/completions", {**body, "prompt": ids[-5:]})["choices"][0]
    assert choice["text"] == same["text"]
    # -1: the model's maximum length, so a short prompt is whole; longer than the prompt: whole.
    for keep in (-1, len(ids) + 3):
        whole = _ok(server_url, "/v1/completions", {**body, "truncate_prompt_tokens": keep})
        assert whole["choices"][0]["prompt_token_ids"] == ids
    chat = _ok(server_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1,
                                                    "truncate_prompt_tokens": 3})
    assert chat["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("value", [0, -2, 10**6])
def test_truncate_prompt_tokens_refused(server_url, helpers, value):
    message = _refused(server_url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1,
                                                       "truncate_prompt_tokens": value}, "truncate_prompt_tokens", helpers)
    if value == 10**6:
        assert str(helpers.MAX_MODEL_LEN) in message


# ---- echo on chat ----------------------------------------------------------------------------------------
def test_chat_echo_continues_the_last_message(server_url, helpers):
    body = {"messages": CONTINUE, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 5,
            "temperature": 0}
    plain = _ok(server_url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    echoed = _ok(server_url, "/v1/chat/completions", {**body, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == CONTINUE[-1]["content"] + plain
    events = _stream(server_url, "/v1/chat/completions", {**body, "echo": True}, helpers)
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == echoed
    # After a generation prompt the reply is a new assistant message: a user's last message is not echoed.
    new = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    assert _ok(server_url, "/v1/chat/completions", {**new, "echo": True})["choices"][0]["message"] \
        == _ok(server_url, "/v1/chat/completions", new)["choices"][0]["message"]


# ---- top_logprobs: -1 and --max-logprobs -----------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": -1},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
])
def test_logprobs_past_the_server_maximum(server_url, helpers, path, body, param):
    message = _refused(server_url, path, {**body, "max_tokens": 1}, param, helpers)
    assert "--max-logprobs" in message and "20" in message


@pytest.fixture(scope="module")
def flag_server_url(start_server, tiny_model_path):
    """The tiny random model (fast to load) with the two flags: logprob tokens as token ids
    by default, and no cap on logprobs (so -1, the whole vocabulary, is allowed)."""
    return start_server(["--model", str(tiny_model_path), "--kv-cache-memory", "0.05",
                         "--return-tokens-as-token-ids", "--max-logprobs", "-1"]).url


def test_server_flags(flag_server_url):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True, "top_logprobs": -1}
    out = _ok(flag_server_url, "/v1/chat/completions", body)
    [entry] = out["choices"][0]["logprobs"]["content"]
    assert TOKEN_ID.fullmatch(entry["token"])  # the flag's default
    assert len(entry["top_logprobs"]) == 49152  # -1: the whole vocabulary
    assert len({t["token"] for t in entry["top_logprobs"]}) == 49152
    plain = _ok(flag_server_url, "/v1/chat/completions",
                {**body, "top_logprobs": 1, "return_tokens_as_token_ids": False})  # the request overrides the flag
    assert not TOKEN_ID.fullmatch(plain["choices"][0]["logprobs"]["content"][0]["top_logprobs"][0]["token"])


# ---- logit_bias and stop_token_ids: every offending key named ---------------------------------------
def test_logit_bias_names_every_bad_key(server_url, helpers):
    long_key = "5" * 5000  # int() of it would raise (Python's digit limit): must be a 400, not a 500
    bias = {"²": 1, "٣": 1, "１２": 1, long_key: 1, "-1": 1, "99999999": 1, " 7": 1, "7": 1, "007": 1, "42": 1}
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        message = _refused(server_url, path, {**body, "max_tokens": 1, "logit_bias": bias}, "logit_bias", helpers)
        for key in ("²", "٣", "１２", "-1", "99999999", " 7", "007"):
            assert repr(key) in message, (key, message)
        assert "'5555" in message and long_key not in message
        assert "these 8 are" in message and "'42'" not in message
    # Valid keys, including leading zeros (as vLLM's int()), are taken.
    _ok(server_url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": {"0042": 1, "7": -1}})


def test_stop_token_ids_names_every_bad_id(server_url, helpers):
    message = _refused(server_url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1,
                                                       "stop_token_ids": [5, 10**6, 49152, 7, 10**7]},
                       "stop_token_ids", helpers)
    assert "1000000, 49152, 10000000" in message and " 5," not in message

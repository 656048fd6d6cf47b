"""Beam search through the real server (vLLM's `use_beam_search`, `length_penalty`, `n` beams):
n choices, best first, on completions and chat, streamed or not; the fields beam search
cannot honour are a 400 naming them. The beams themselves equal Hugging Face's:
tests/engine/test_beam_search.py."""

from __future__ import annotations

import httpx
import pytest

PROMPT = "The capital of France is"


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_completions_return_n_beams_best_first(server_url, model_name, helpers):
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 8, "n": 3, "use_beam_search": True,
            "length_penalty": 0.0, "logprobs": 0}
    r = _post(server_url, "/v1/completions", body)
    assert r.status_code == 200, r.text[:500]
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) == 3, choices  # three different beams
    # length_penalty 0: a beam's score is its cumulative log-probability, so they come sorted by it.
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert sums == sorted(sums, reverse=True), sums
    assert r.json()["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in choices)
    # A beam of width 1 is greedy decoding.
    one = _post(server_url, "/v1/completions", {**body, "n": 1, "logprobs": None, "length_penalty": 1.0}).json()
    greedy = _post(server_url, "/v1/completions", {"model": model_name, "prompt": PROMPT, "max_tokens": 8,
                                                    "temperature": 0}).json()
    assert one["choices"][0]["text"] == greedy["choices"][0]["text"]
    metrics = helpers.wait_idle(server_url)
    assert metrics["pagoda:kv_cache_usage_perc"] == 0.0


def test_chat_and_stream_return_the_same_beams(client, server_url, model_name, helpers):
    messages = [{"role": "user", "content": "Name a fruit."}]
    extra = {"use_beam_search": True}
    whole = client.chat.completions.create(model=model_name, messages=messages, n=2, max_tokens=8, temperature=0,
                                           extra_body=extra)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in whole.choices)
    streamed = {0: "", 1: ""}
    finish = {}
    for chunk in client.chat.completions.create(model=model_name, messages=messages, n=2, max_tokens=8, temperature=0,
                                                stream=True, extra_body=extra):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert [streamed[0], streamed[1]] == [c.message.content for c in whole.choices]
    assert [finish[0], finish[1]] == [c.finish_reason for c in whole.choices]
    # Completions streamed: each choice's text arrives (at the end) whole.
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 6, "n": 2, "use_beam_search": True}
    plain = _post(server_url, "/v1/completions", body).json()["choices"]
    with httpx.stream("POST", f"{server_url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = helpers.parse_sse(r.iter_lines())
    texts = {0: "", 1: ""}
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
    assert [texts[0], texts[1]] == [c["text"] for c in plain]


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 0.7}, "temperature"),
    ({"top_p": 0.5}, "top_p"),
    ({"top_k": 5}, "top_k"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 2}}, "logit_bias"),
    ({"stop": ["."]}, "stop"),
    ({"best_of": 4}, "best_of"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"max_tokens": 0, "echo": True}, "max_tokens"),
    ({"n": 10_000}, "n"),
    ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_fields_beam_search_cannot_honour_are_refused(server_url, model_name, helpers, fields, param):
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True, **fields}
    r = _post(server_url, "/v1/completions", body)
    assert r.status_code == 400, r.text[:500]
    assert helpers.assert_error_envelope(r.json())["param"] == param

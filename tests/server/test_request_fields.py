"""Every OpenAI request field is implemented, an accepted no-op, or a 400 naming it.

Against the real server: the refusals (each a 400 in the OpenAI envelope with the right
`param`), the no-op fields (200), unknown fields (200, logged once per name) and
`best_of` on completions. Parsing and spec building without a server:
test_protocol_unit.py. Constrained decoding itself is tested elsewhere.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hello"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def chat(**fields):
    return CHAT, {"model": "__MODEL__", "messages": USER, "max_tokens": 2, **fields}


def comp(**fields):
    return COMPLETIONS, {"model": "__MODEL__", "prompt": "Hello", "max_tokens": 2, **fields}


REFUSED = {
    "response_format_bogus_type": (comp(response_format={"type": "xml"}), "response_format"),
    "json_schema_without_schema": (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
                                   "response_format"),
    "two_constraints": (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                             guided_regex="[a-z]+"), "guided_regex"),
    "two_structured_outputs_keys": (comp(structured_outputs={"regex": "a+", "choice": ["a", "b"]}), "structured_outputs"),
    "structured_outputs_unsupported_option": (chat(structured_outputs={"json": SCHEMA, "whitespace_pattern": " "}),
                                              "structured_outputs.whitespace_pattern"),
    "guided_json_not_json": (comp(guided_json="{not json"), "guided_json"),
    "guided_decoding_backend_unknown": (chat(guided_decoding_backend="outlines", guided_regex="a"),
                                        "guided_decoding_backend"),
    "tool_choice_unknown_tool": (chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
                                 "tool_choice"),
    "tool_choice_required_without_tools": (chat(tool_choice="required"), "tool_choice"),
    "custom_tool_type": (chat(tools=[{"type": "custom", "custom": {"name": "x"}}]), "tools"),
    "tools_and_functions": (chat(tools=[TOOL], functions=[TOOL["function"]]), "functions"),
    "tool_message_without_tool_call_id": (chat(messages=[*USER, {"role": "tool", "content": "42"}]), "messages"),
    "image_url_part": (chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
        "messages"),
    "audio": (chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    "prediction": (chat(prediction={"type": "content", "content": "Hello"}), "prediction"),
    "web_search_options": (chat(web_search_options={}), "web_search_options"),
    "modalities_audio": (chat(modalities=["text", "audio"]), "modalities"),
    "tools_on_completions": (comp(tools=[TOOL]), "tools"),
    "best_of_on_chat": (chat(best_of=2), "best_of"),
    "best_of_with_stream": (comp(best_of=3, stream=True), "best_of"),
    "best_of_below_n": (comp(best_of=1, n=2), "best_of"),
    "best_of_over_max_n": (comp(best_of=1000), "best_of"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_with_param(case, server_url, model_name, helpers):
    (path, body), param = REFUSED[case]
    body = {**body, "model": model_name}
    r = httpx.post(f"{server_url}{path}", json=body, timeout=60)
    assert r.status_code == 400, f"{r.status_code}: {r.text[:500]}"
    err = helpers.assert_error_envelope(r.json())
    assert err["type"] == "invalid_request_error", err
    assert err["param"] == param, err


def test_noop_fields_are_accepted(server_url, model_name):
    noops = dict(
        user="u-1", store=False, metadata={"team": "search"}, service_tier="auto", reasoning_effort="low",
        verbosity="low", prompt_cache_key="k", prompt_cache_retention="24h", safety_identifier="s-1",
        modalities=["text"],
    )
    for path, body in (chat(parallel_tool_calls=False, **noops), comp(**noops)):
        r = httpx.post(f"{server_url}{path}", json={**body, "model": model_name, "temperature": 0}, timeout=60)
        assert r.status_code == 200, f"{path}: {r.status_code}: {r.text[:500]}"
        assert r.json()["usage"]["completion_tokens"] >= 1


def test_tool_history_and_text_format_are_accepted(server_url, model_name):
    """Tool-call history renders (content null beside tool_calls, a tool reply), and
    response_format "text" is no constraint."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    path, body = chat(messages=messages, tools=[TOOL], tool_choice="none", response_format={"type": "text"})
    r = httpx.post(f"{server_url}{path}", json={**body, "model": model_name, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text[:500]


def test_unknown_field_is_logged_once(server, model_name):
    field = f"frobnicate_{uuid.uuid4().hex[:8]}"
    for _ in range(2):
        path, body = comp(**{field: 3})
        r = httpx.post(f"{server.url}{path}", json={**body, "model": model_name}, timeout=60)
        assert r.status_code == 200, r.text[:500]
    warning = f"ignoring unknown request field {field!r} (not an OpenAI or vLLM field)"
    deadline = time.monotonic() + 10
    while warning not in server.log_path.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.1)  # stderr reaches the file on its own schedule
    assert server.log_path.read_text(errors="replace").count(warning) == 1


def _cumulative(choice: dict) -> float:
    return sum(choice["logprobs"]["token_logprobs"])


def test_best_of_returns_the_most_likely_sample(server_url, model_name):
    """best_of=3 runs the same 3 samples as n=3 with the same seed (child seeds are seed + j)
    and returns the one with the highest cumulative logprob; usage counts all three."""
    common = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 1234,
              "logprobs": 0}
    with httpx.Client(base_url=server_url, timeout=120) as http:
        best = http.post(COMPLETIONS, json={**common, "best_of": 3, "n": 1})
        every = http.post(COMPLETIONS, json={**common, "n": 3})
    assert best.status_code == 200 and every.status_code == 200, (best.text[:300], every.text[:300])
    best, every = best.json(), every.json()
    [chosen] = best["choices"]
    assert chosen["index"] == 0
    samples = {c["text"]: _cumulative(c) for c in every["choices"]}
    assert chosen["text"] in samples, (chosen["text"], samples)
    assert _cumulative(chosen) >= max(samples.values()) - 1e-4, (chosen, samples)
    assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]
    assert best["usage"]["completion_tokens"] > len(chosen["logprobs"]["tokens"])


def test_best_of_without_logprobs_hides_them(server_url, model_name):
    r = httpx.post(f"{server_url}{COMPLETIONS}", json={
        "model": model_name, "prompt": ["Hello", "Goodbye"], "max_tokens": 4, "seed": 7, "best_of": 2, "n": 1,
    }, timeout=120)
    assert r.status_code == 200, r.text[:500]
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in out["choices"])

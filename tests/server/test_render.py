"""vLLM's render routes through the shared server (server/serving_render.py): the token ids a
request would prefill, equal to what the generating route prefilled for the same request
(its `prompt_token_ids` with `return_token_ids`, and `usage.prompt_tokens`), for a chat with
tools and a response_format; the routes' own 400s for bad requests; nothing is generated."""

from __future__ import annotations

import httpx
import pytest

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
CHAT = {
    "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}],
    "tools": TOOLS, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    "max_tokens": 4, "temperature": 0,
}


def _post(server_url, path, body, status=200):
    r = httpx.post(f"{server_url}{path}", json=body, timeout=120)
    assert r.status_code == status, r.text[:400]
    return r.json()


def test_chat_render_is_what_the_chat_route_prefills(server_url, model_name):
    body = {"model": model_name, **CHAT}
    rendered = _post(server_url, "/v1/chat/completions/render", body)
    assert rendered["request_id"].startswith("chatcmpl-") and rendered["model"] == model_name
    assert rendered["sampling_params"]["max_tokens"] == 4 and rendered["sampling_params"]["temperature"] == 0
    assert rendered["sampling_params"]["structured_output"]["param"] == "response_format"
    ran = _post(server_url, "/v1/chat/completions", {**body, "return_token_ids": True})
    assert rendered["token_ids"] == ran["prompt_token_ids"]
    assert len(rendered["token_ids"]) == ran["usage"]["prompt_tokens"]
    # The tools are in the prompt: without them it renders shorter.
    bare = _post(server_url, "/v1/chat/completions/render", {**body, "tools": None})
    assert len(bare["token_ids"]) < len(rendered["token_ids"])


def test_completion_render_gives_one_entry_per_prompt(server_url, model_name):
    body = {"model": model_name, "prompt": ["The capital of France is", "One two three four five"], "max_tokens": 3,
            "truncate_prompt_tokens": 3}
    rendered = _post(server_url, "/v1/completions/render", body)
    assert [len(r["token_ids"]) for r in rendered] == [3, 3]
    whole = _post(server_url, "/tokenize", {"model": model_name, "prompt": "One two three four five"})["tokens"]
    assert rendered[1]["token_ids"] == whole[-3:]  # the last 3 kept, as the route keeps them
    assert rendered[0]["request_id"] != rendered[1]["request_id"]
    ran = _post(server_url, "/v1/completions", {**body, "return_token_ids": True})
    assert [r["token_ids"] for r in rendered] == [c["prompt_token_ids"] for c in ran["choices"]]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions/render", {"messages": []}, "messages"),
    ("/v1/chat/completions/render", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "properties": {"x": {"$ref": "#/nope"}}}}}}, "response_format"),
    ("/v1/completions/render", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions/render", {"prompt": [10**9]}, "prompt"),
])
def test_bad_requests_get_the_routes_own_400(server_url, model_name, path, body, param):
    error = _post(server_url, path, {"model": model_name, **body}, status=400)["error"]
    assert error["param"] == param, error
    # The same request on the generating route: the same refusal.
    route = path.removesuffix("/render")
    assert _post(server_url, route, {"model": model_name, **body}, status=400)["error"]["param"] == param


def test_render_generates_nothing(server_url, model_name):
    def generated() -> float:
        text = httpx.get(f"{server_url}/metrics", timeout=30).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("pagoda:generation_tokens_total"))

    before = generated()
    for _ in range(3):
        _post(server_url, "/v1/chat/completions/render", {"model": model_name, **CHAT})
    assert generated() == before

"""Structured outputs through the real server and the official `openai` client: every
output parses and validates against its schema, greedy and sampled, for each form
(`response_format`, `structured_outputs`, the `guided_*` aliases), on both endpoints."""

from __future__ import annotations

import asyncio
import json
import random
import re
import string

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

# Strings and arrays are bounded so that a sampled (temperature 1) output always completes
# within max_tokens: an unfinished JSON text could not be validated.
NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": NAME, "address": {
            "type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "defs_ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                                       "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                                     "required": ["x", "y"], "additionalProperties": False}},
                 "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
                 "required": ["start", "end"], "additionalProperties": False},
    "array_bounds": {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4}},
                     "required": ["tags"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "integer_range": {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                                       "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50}},
                      "required": ["year", "count"], "additionalProperties": False},
    "number_range": {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
                     "required": ["score"], "additionalProperties": False},
    "string_pattern_length": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "nick": {"type": "string", "minLength": 3, "maxLength": 6}},
        "required": ["code", "nick"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, NAME]}},
               "required": ["value"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"nickname": {"type": ["string", "null"], "maxLength": 8},
                                                  "parent": {"anyOf": [{"type": "null"}, NAME]}},
                 "required": ["nickname", "parent"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "done": {"type": "boolean"}},
        "required": ["id", "done"], "additionalProperties": False}},
}
MAX_TOKENS = 200


def _messages(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with a JSON value for a '{name}' record."}]


async def _all_outputs(make_client, model_name) -> dict[tuple[str, str], list]:
    """Every schema, greedy (n=1) and sampled (n=3, temperature 1), all in flight at once."""
    client = make_client()
    jobs = {}
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        jobs[(name, "greedy")] = client.chat.completions.create(
            model=model_name, messages=_messages(name), response_format=fmt, max_tokens=MAX_TOKENS, temperature=0)
        jobs[(name, "sampled")] = client.chat.completions.create(
            model=model_name, messages=_messages(name), response_format=fmt, max_tokens=MAX_TOKENS,
            temperature=1.0, n=3, seed=4)
    results = await asyncio.gather(*jobs.values())
    await client.close()
    return dict(zip(jobs, results))


@pytest.fixture(scope="module")
def schema_outputs(async_client_factory_module, model_name):
    return asyncio.run(_all_outputs(async_client_factory_module, model_name))


@pytest.fixture(scope="module")
def async_client_factory_module(server_url):
    return lambda: openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_validates_against_its_schema(schema_outputs, name, mode):
    response = schema_outputs[(name, mode)]
    assert len(response.choices) == (1 if mode == "greedy" else 3)
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Describe a cat as a JSON object with keys name and color."}],
        response_format={"type": "json_object"}, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


class Person(BaseModel):
    name: str
    age: int
    email: str | None


def test_sdk_parse_returns_the_pydantic_object(client, model_name):
    r = client.chat.completions.parse(
        model=model_name, messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person, max_tokens=MAX_TOKENS, temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person)
    assert Person.model_validate_json(r.choices[0].message.content) == parsed


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_regex": r"(yes|no), because [a-z ]{1,30}\."}, lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,30}\.", t)),
    ({"structured_outputs": {"choice": ["Paris", "London", "New York"]}}, lambda t: t in ("Paris", "London", "New York")),
    ({"guided_choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
    ({"structured_outputs": {"grammar": 'start: NUM " + " NUM " = " NUM\nNUM: /[0-9]{1,3}/'}},
     lambda t: re.fullmatch(r"[0-9]{1,3} \+ [0-9]{1,3} = [0-9]{1,3}", t)),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                      "additionalProperties": False}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
], ids=["regex", "guided_regex", "choice", "guided_choice", "lark_grammar", "guided_json"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_regex_choice_grammar_forms(client, model_name, extra, check, endpoint):
    if endpoint == "chat":
        r = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Answer."}], max_tokens=60, temperature=1.0,
            seed=3, extra_body=extra)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    else:
        r = client.completions.create(model=model_name, prompt="Answer:", max_tokens=60, temperature=1.0, seed=3,
                                      extra_body=extra)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert reason == "stop" and check(text), text


def test_streamed_json_concatenates_to_a_valid_object(client, model_name):
    schema = SCHEMAS["nested"]
    stream = client.chat.completions.create(
        model=model_name, messages=_messages("nested"), max_tokens=MAX_TOKENS, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def test_permissive_grammar_leaves_greedy_output_unchanged(client, model_name):
    kw = dict(model=model_name, prompt="The capital of France is", max_tokens=12, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    constrained = client.completions.create(**kw, extra_body={"structured_outputs": {"regex": r"[\s\S]*"}})
    assert constrained.choices[0].text == free


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
], ids=["invalid_schema", "invalid_regex", "undefined_rule", "broken_gbnf"])
def test_invalid_grammar_is_a_400_naming_the_field(server_url, model_name, helpers, body, param):
    for stream in (False, True):  # refused before any stream starts
        r = httpx.post(f"{server_url}/v1/chat/completions", timeout=60, json={
            "model": model_name, "messages": [{"role": "user", "content": "x"}], "stream": stream, **body})
        assert r.status_code == 400, r.text
        assert helpers.assert_error_envelope(r.json())["param"] == param
    ok = httpx.post(f"{server_url}/v1/completions", timeout=60,
                    json={"model": model_name, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_cached_grammar_failure_names_each_requests_own_field(server_url, model_name, helpers):
    """Failed compiles are cached by content: the same broken grammar sent in another field
    must name that field, not the one of the request that compiled it first."""
    grammar = "root ::= ( [0-9"  # unclosed: this exact text appears in no other test
    for body, param in (({"grammar": grammar}, "grammar"),
                        ({"structured_outputs": {"grammar": grammar}}, "structured_outputs"),
                        ({"guided_grammar": grammar}, "guided_grammar")):
        r = httpx.post(f"{server_url}/v1/completions", timeout=60,
                       json={"model": model_name, "prompt": "x", "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        assert helpers.assert_error_envelope(r.json())["param"] == param


def test_slow_compile_does_not_delay_an_unconstrained_request(server_url, model_name):
    """A ~1 MB choice list takes seconds to compile; a plain request sent after it ends first."""
    rnd = random.Random(0)
    words = ["".join(rnd.choice(string.ascii_lowercase) for _ in range(12)) for _ in range(60000)]

    async def run() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(base_url=server_url, timeout=120) as http:
            async def send(label: str, body: dict) -> None:
                r = await http.post("/v1/completions", json={"model": model_name, "prompt": "Pick:", **body})
                # The slow one may also hit --grammar-compile-timeout on a loaded machine: a 400.
                assert r.status_code in (200, 400), r.text
                finished.append(label)

            slow = asyncio.create_task(send("slow", {"max_tokens": 8, "structured_outputs": {"choice": words}}))
            await asyncio.sleep(0.3)  # the slow one is compiling
            await send("plain", {"max_tokens": 4})
            await slow
        return finished

    assert asyncio.run(run()) == ["plain", "slow"]


def test_metrics_count_constrained_requests_and_compiles(server_url, model_name, helpers):
    before = helpers.scrape_metrics(server_url)
    body = {"model": model_name, "prompt": "x", "max_tokens": 4}
    regex = f"[a-z]{{1,{random.randint(100, 10**6)}}}"  # a fresh grammar: a real compile
    assert httpx.post(f"{server_url}/v1/completions", json={**body, "guided_regex": regex}, timeout=60).status_code == 200
    broken = f"[a-{random.randint(0, 10**6)}"  # fresh too: a cached failure is not recompiled
    assert httpx.post(f"{server_url}/v1/completions", json={**body, "guided_regex": broken}, timeout=60).status_code == 400
    after = helpers.scrape_metrics(server_url)
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    assert delta("pagoda:structured_output_requests_total") == 1
    assert delta("pagoda:grammar_compile_seconds_count") == 2
    assert delta("pagoda:grammar_compile_failures_total") == 1

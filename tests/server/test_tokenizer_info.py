"""GET /tokenizer_info as vLLM serves it, for clients that tokenize through the server
(lm-eval's `local-completions` with `tokenizer_backend=remote`)."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from server.app import OPEN_PATHS, APIKeyMiddleware
from server.tenants import KeyRegistry
from server.tokenizer_info import tokenizer_config


@pytest.fixture(scope="module")
def info(server_url) -> dict:
    r = httpx.get(f"{server_url}/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    return r.json()


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_path):
    return AutoTokenizer.from_pretrained(str(default_model_path))


def test_special_tokens_are_the_models(info, hf_tokenizer):
    assert info["eos_token"] == hf_tokenizer.eos_token == "<|im_end|>"
    assert info["bos_token"] == hf_tokenizer.bos_token == "<|im_start|>"
    assert info["pad_token"] == hf_tokenizer.pad_token
    assert info["unk_token"] == hf_tokenizer.unk_token


def test_tokenizer_class_and_lengths(info, hf_tokenizer, helpers):
    assert info["tokenizer_class"] == type(hf_tokenizer).__name__
    assert info["model_max_length"] == hf_tokenizer.model_max_length  # the tokenizer's own, as vLLM
    assert info["max_model_len"] == helpers.MAX_MODEL_LEN  # the server's limit


def test_chat_template_is_the_one_the_server_renders(info, hf_tokenizer):
    assert info["chat_template"] == hf_tokenizer.chat_template
    # What a remote-tokenizer client does with it (lm-eval renders it with jinja2).
    import jinja2

    template = jinja2.Environment().from_string(info["chat_template"])
    text = template.render(messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)


def test_no_server_paths_and_plain_json(info, server_url, default_model_path):
    assert not [k for k in info if k.endswith("_file")]
    # Names, not the server's paths: neither here nor in /v1/models' `root`.
    assert info["name_or_path"] == default_model_path.name
    models = httpx.get(f"{server_url}/v1/models", timeout=10).json()["data"]
    assert models[0]["root"] == default_model_path.name
    for body in (json.dumps(info), json.dumps(models)):
        assert str(default_model_path.parent) not in body
    # Special tokens come as text, not as AddedToken reprs.
    assert all("AddedToken" not in json.dumps(v) for v in info.values())
    decoder = info.get("added_tokens_decoder")
    if decoder is not None:
        assert decoder["2"] == "<|im_end|>"


def test_remote_tokenizer_round_trip(server_url, info, hf_tokenizer):
    """What lm-eval's RemoteTokenizer does: eos id = /tokenize of eos_token (no `model` field,
    add_special_tokens false); text through /tokenize and /detokenize."""
    r = httpx.post(f"{server_url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == [hf_tokenizer.eos_token_id]
    text = "The capital of France is Paris."
    r = httpx.post(f"{server_url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    tokens = r.json()["tokens"]
    assert tokens == hf_tokenizer.encode(text, add_special_tokens=False)
    r = httpx.post(f"{server_url}/detokenize", json={"tokens": tokens}, timeout=30)
    assert r.status_code == 200 and r.json()["prompt"] == text


def test_server_chat_template_override_wins(hf_tokenizer):
    override = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert tokenizer_config(hf_tokenizer, override, 512)["chat_template"] == override
    assert tokenizer_config(hf_tokenizer, None, 512)["chat_template"] == hf_tokenizer.chat_template


def test_tokenizer_config_is_json_for_odd_values():
    class Token:
        content = "<s>"

    class Odd:
        init_kwargs = {"bos_token": Token(), "vocab_file": "/srv/x/vocab.json", "tokens": (Token(), 1),
                       "nested": {3: Token(), (1, 2): object()}}
        eos_token = "</s>"
        chat_template = None

    body = tokenizer_config(Odd(), None, 64)
    json.dumps(body)
    assert body["bos_token"] == "<s>" and body["eos_token"] == "</s>"
    assert "vocab_file" not in body and "chat_template" not in body
    assert body["tokens"] == ["<s>", 1] and body["nested"][3] == "<s>"
    assert body["tokenizer_class"] == "Odd" and body["max_model_len"] == 64


def test_behind_the_api_key():
    """Not an open path, so APIKeyMiddleware asks for the key (tests/server/test_auth.py
    holds the middleware to that on every such route)."""
    assert "/tokenizer_info" not in OPEN_PATHS
    import asyncio

    sent = []

    async def app(scope, receive, send):  # reached only with the key
        sent.append("app")

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    middleware = APIKeyMiddleware(app, KeyRegistry(api_key="secret"))
    scope = {"type": "http", "path": "/tokenizer_info", "method": "GET", "headers": []}
    asyncio.run(middleware(scope, receive, send))
    assert sent[0]["status"] == 401 and "app" not in sent
    sent.clear()
    scope["headers"] = [(b"authorization", b"Bearer secret")]
    asyncio.run(middleware(scope, receive, send))
    assert sent == ["app"]

"""LoRA adapters through the real server (server/serving_lora.py) on the tiny random Llama:
`model` selects an adapter, /v1/models lists them with `parent`, runtime load/unload under
--lora-dir roots, 404 for an unloaded adapter, 400 for a path outside the roots, and the
gateways' `vllm:lora_requests_info` metric."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def lora_server(start_server, tiny_model_path, tmp_path_factory):
    from tiny_models import make_lora_adapter

    root = tmp_path_factory.mktemp("lora-root")
    outside = tmp_path_factory.mktemp("lora-outside")
    make_lora_adapter(tiny_model_path, root / "a1", seed=1)
    make_lora_adapter(tiny_model_path, outside / "a2", seed=2)
    (root / "escape").symlink_to(outside / "a2")  # inside by name, outside once resolved
    server = start_server(["--model", str(tiny_model_path), "--kv-cache-memory", "0.05",
                           "--lora-modules", f"start={root / 'a1'}", "--allow-runtime-lora-loading",
                           "--lora-dir", str(root)])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    return server.url, client, root, outside


def _text(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.model == model  # the adapter's name, as vLLM echoes it
    return out.choices[0].text


def test_adapters_by_model_name_and_runtime_load_unload(lora_server):
    url, client, root, outside = lora_server
    models = {m.id: m for m in client.models.list().data}
    [base] = [name for name in models if name != "start"]
    assert models["start"].model_extra["parent"] == base
    assert models[base].model_extra.get("parent") is None

    base_text, start_text = _text(client, base), _text(client, "start")
    assert start_text != base_text  # the adapter changes what the model says

    # Runtime load of the same folder under another name: the same tokens as at start-up.
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(root / "a1")})
    assert r.status_code == 200, r.text
    assert "rt" in {m.id for m in client.models.list().data}
    assert _text(client, "rt") == start_text
    chat = client.chat.completions.create(model="rt", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.model == "rt" and chat.choices[0].message.content is not None
    response = client.responses.create(model="rt", input="Hi", max_output_tokens=2)
    assert response.model == "rt" and response.status in ("completed", "incomplete")

    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "rt"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as e:
        _text(client, "rt")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "rt"})
    assert r.status_code == 404, r.text
    with pytest.raises(openai.NotFoundError):
        _text(client, "no-such-adapter")
    assert _text(client, "start") == start_text  # the start-up adapter is untouched


@pytest.mark.parametrize("where", ["outside", "symlink-out", "dotdot"])
def test_paths_outside_the_roots_are_refused(lora_server, where):
    url, client, root, outside = lora_server
    path = {"outside": outside / "a2", "symlink-out": root / "escape",
            "dotdot": root / ".." / outside.name / "a2"}[where]
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "outside the allowed --lora-dir roots" in error["message"] and error["param"] == "lora_path"
    assert "x" not in {m.id for m in client.models.list().data}


def test_bad_adapter_folder_is_a_400(lora_server):
    url, _, root, _ = lora_server
    (root / "empty").mkdir(exist_ok=True)
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "e", "lora_path": str(root / "empty")})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "start", "lora_path": str(root / "a1")})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"], r.text


def test_lora_requests_info_metric(lora_server):
    url, client, _, _ = lora_server
    _text(client, "start")
    text = httpx.get(f"{url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = families["vllm:lora_requests_info"].samples
    assert samples and all(s.labels["max_lora"] == "4" for s in samples)
    assert {"running_lora_adapters", "waiting_lora_adapters"} <= set(samples[0].labels)
    assert max(s.value for s in samples) > 1e9  # a timestamp, as vLLM's
    [started] = [s for s in families["pagoda:lora_requests"].samples
                 if s.name == "pagoda:lora_requests_total" and s.labels["lora_name"] == "start"]
    assert started.value >= 1


def test_runtime_loading_is_off_by_default(server_url):
    r = httpx.post(f"{server_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert r.status_code == 404 and "--allow-runtime-lora-loading" in r.json()["error"]["message"], r.text

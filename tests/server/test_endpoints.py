"""The small endpoints: /v1/models, /tokenize, /detokenize, /health, /version."""

import httpx


def test_models_lists_the_served_model(client, server_url):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert len(ids) == 1, ids
    assert ids[0], ids
    assert models.data[0].object == "model"
    raw = httpx.get(f"{server_url}/v1/models", timeout=10).json()
    assert raw["object"] == "list"
    assert raw["data"][0]["id"] == ids[0]
    # the served name is accepted as `model` (the default model is the SmolLM2 folder)
    assert "smollm2" in ids[0].lower()


def test_tokenize_detokenize_round_trip(server_url, model_name, helpers):
    text = "Hello, world! Paged attention: naïve café, 東京, 12345."
    r = httpx.post(f"{server_url}/tokenize", json={"model": model_name, "prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    tokens = body["tokens"]
    assert isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens)
    assert body["count"] == len(tokens)
    assert body["max_model_len"] == helpers.MAX_MODEL_LEN
    r = httpx.post(f"{server_url}/detokenize", json={"model": model_name, "tokens": tokens}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == text


def test_tokenize_counts_match_completion_usage(client, server_url, model_name, helpers):
    prompt = "Count my tokens, please."
    ids = helpers.tokenize(server_url, model_name, prompt)
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens == len(ids)


def test_health_is_200(server_url):
    r = httpx.get(f"{server_url}/health", timeout=10)
    assert r.status_code == 200


def test_version_reports_a_version(server_url):
    r = httpx.get(f"{server_url}/version", timeout=10)
    assert r.status_code == 200
    version = r.json()["version"]
    assert isinstance(version, str) and version

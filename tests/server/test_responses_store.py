"""The Responses store through a real server started with `--api-key` and a small
`--responses-store-size`: filled past its limit the oldest responses go (404 in the envelope)
and the store's size gauges fall back to their baseline once the rest are deleted; a
continuation of an evicted response is a 404 and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

KEY = "store-secret"
STORE_SIZE = 3
STORED = "pagoda:responses_stored"
STORE_BYTES = "pagoda:responses_store_bytes"


@pytest.fixture(scope="module")
def store_server(start_server):
    server = start_server(["--api-key", KEY, "--responses-store-size", str(STORE_SIZE),
                           "--responses-store-ttl", "600"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def store_client(store_server):
    return openai.OpenAI(base_url=f"{store_server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_filled_past_its_limit_the_oldest_are_evicted(store_server, store_client, helpers):
    url = store_server.url
    baseline = helpers.scrape_metrics(url)
    assert baseline[STORED] == 0 and baseline[STORE_BYTES] == 0
    ids = [store_client.responses.create(input=f"Say the number {i}.", max_output_tokens=3, temperature=0).id
           for i in range(STORE_SIZE + 2)]
    full = helpers.scrape_metrics(url)
    assert full[STORED] == STORE_SIZE and full[STORE_BYTES] > 0
    for evicted in ids[:2]:
        got = httpx.get(f"{url}/v1/responses/{evicted}", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert got.status_code == 404 and helpers.assert_error_envelope(got.json())["code"] == "not_found"
        with pytest.raises(openai.NotFoundError):
            store_client.responses.create(input="And then?", previous_response_id=evicted, max_output_tokens=2)
    kept = [store_client.responses.retrieve(i) for i in ids[2:]]
    assert [r.id for r in kept] == ids[2:]
    # Using a response makes it the most recently used: the next one evicts ids[3], not ids[2].
    store_client.responses.retrieve(ids[2])
    newest = store_client.responses.create(input="Hi", max_output_tokens=2, previous_response_id=ids[2]).id
    store_client.responses.retrieve(ids[2])
    with pytest.raises(openai.NotFoundError):
        store_client.responses.retrieve(ids[3])
    for i in (ids[2], ids[4], newest):
        store_client.responses.delete(i)  # the SDK returns None; a failure would raise
    after = helpers.scrape_metrics(url)
    assert after[STORED] == baseline[STORED] and after[STORE_BYTES] == baseline[STORE_BYTES]


def test_another_key_cannot_read_a_response(store_server, store_client, helpers):
    r = store_client.responses.create(input="Hello", max_output_tokens=2)
    for headers in ({}, {"Authorization": "Bearer other-key"}):
        got = httpx.get(f"{store_server.url}/v1/responses/{r.id}", headers=headers, timeout=10)
        assert got.status_code == 401
        helpers.assert_error_envelope(got.json())
    assert store_client.responses.retrieve(r.id).id == r.id
    store_client.responses.delete(r.id)

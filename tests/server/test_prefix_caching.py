"""Automatic prefix caching as a client sees it: `usage.prompt_tokens_details.cached_tokens`,
`cache_salt`, the prefix-cache counters on /metrics, and `--no-prefix-caching`."""

import uuid

import httpx
import pytest

BLOCK_SIZE = 16  # the server's default --block-size
QUERIES = "pagoda:prefix_cache_queries_total"
HITS = "pagoda:prefix_cache_hits_total"


def long_prompt() -> str:
    """A prompt of > 64 tokens that no other test sends (a shared prefix would be cached)."""
    return (
        f"Request {uuid.uuid4().hex}. The Silk Road was a network of trade routes connecting East Asia "
        "with the Mediterranean world. Merchants carried silk, spices, tea and porcelain westward, "
        "while horses, glassware, wool and silver travelled east, and ideas, religions and "
        "technologies moved along the same caravan paths for more than fifteen centuries."
    )


def _complete(client, model_name, prompt, **kwargs):
    kwargs = {"max_tokens": 8, "temperature": 0, "logprobs": 1, **kwargs}
    return client.completions.create(model=model_name, prompt=prompt, **kwargs)


def _cached(out) -> int:
    return out.usage.prompt_tokens_details.cached_tokens


def test_repeated_prompt_is_served_from_the_cache(client, model_name):
    prompt = long_prompt()
    first = _complete(client, model_name, prompt)
    second = _complete(client, model_name, prompt)
    num_prompt = first.usage.prompt_tokens
    assert num_prompt >= 64
    assert _cached(first) == 0
    # every full block but the one holding the last prompt token (its logits are needed)
    assert _cached(second) == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    a, b = first.choices[0], second.choices[0]
    assert b.text == a.text
    assert b.logprobs.tokens == a.logprobs.tokens
    # Equal up to float32 rounding: the cached run computes the prompt tail in a different
    # batch shape (differences of ~1e-6 on a CPU), never a different token.
    assert b.logprobs.token_logprobs == pytest.approx(a.logprobs.token_logprobs, abs=1e-4)


def test_cache_salt_separates_the_caches(client, model_name):
    prompt = long_prompt()
    salted = _complete(client, model_name, prompt, extra_body={"cache_salt": "tenant-a"})
    other_salt = _complete(client, model_name, prompt, extra_body={"cache_salt": "tenant-b"})
    unsalted = _complete(client, model_name, prompt)
    same_salt = _complete(client, model_name, prompt, extra_body={"cache_salt": "tenant-a"})
    assert _cached(salted) == 0
    assert _cached(other_salt) == 0
    assert _cached(unsalted) == 0
    assert _cached(same_salt) > 0
    assert {o.choices[0].text for o in (salted, other_salt, unsalted, same_salt)} == {salted.choices[0].text}


def test_cached_tokens_sum_over_prompts_not_samples(client, server_url, model_name, helpers):
    prompts = [long_prompt(), long_prompt()]
    _complete(client, model_name, prompts)
    again = _complete(client, model_name, prompts, n=3, temperature=1.0, seed=1)
    lengths = [len(helpers.tokenize(server_url, model_name, p)) for p in prompts]
    assert again.usage.prompt_tokens == sum(lengths)
    assert _cached(again) == sum((n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in lengths)


def test_streamed_usage_reports_cached_tokens(client, model_name):
    prompt = long_prompt()
    full = _complete(client, model_name, prompt)
    chunks = list(_complete(client, model_name, prompt, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_chat_reports_cached_tokens(client, model_name):
    messages = [{"role": "user", "content": long_prompt()}]
    kwargs = dict(model=model_name, messages=messages, max_tokens=6, temperature=0)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    streamed = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    num_prompt = first.usage.prompt_tokens
    # The chat template's system prompt starts every conversation: its blocks may be cached already.
    assert first.usage.prompt_tokens_details.cached_tokens < num_prompt // 2
    assert second.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.choices[0].message.content == first.choices[0].message.content
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens > 0
    salted = client.chat.completions.create(extra_body={"cache_salt": "chat-salt"}, **kwargs)
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_prefix_cache_counters_count_hits(client, server_url, model_name, helpers):
    prompt = long_prompt()
    before = helpers.scrape_metrics(server_url)
    first = _complete(client, model_name, prompt)
    middle = helpers.scrape_metrics(server_url)
    second = _complete(client, model_name, prompt)
    after = helpers.scrape_metrics(server_url)
    # Queries count prompt tokens looked up, hits the tokens found; the two requests run
    # one after the other, so nothing else moves the counters in between.
    assert middle[QUERIES] - before[QUERIES] == first.usage.prompt_tokens
    assert middle[HITS] - before[HITS] == 0
    assert after[QUERIES] - middle[QUERIES] == second.usage.prompt_tokens
    assert after[HITS] - middle[HITS] == _cached(second) > 0


# ---- --no-prefix-caching -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uncached_server(start_server):
    server = start_server(["--no-prefix-caching"])
    yield server
    server.stop()


def test_no_prefix_caching_flag_turns_reuse_off(uncached_server, helpers):
    url = uncached_server.url
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": long_prompt(), "max_tokens": 4, "temperature": 0}
    outs = [httpx.post(f"{url}/v1/completions", json=body, timeout=60).json() for _ in range(2)]
    assert [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs] == [0, 0]
    assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]
    assert helpers.scrape_metrics(url)[HITS] == 0

"""POST /v1/completions through the official openai client, against the real server."""

import math

import pytest

# Greedy continuations of these (bundled model) cover plain text, code with newlines,
# Japanese and a run of 4-byte emoji: multi-byte characters split across tokens.
PROMPTS = {
    "plain": "Once upon a time, in a small village,",
    "code": "def fibonacci(n):",
    "japanese": "In Japanese, 'thank you' is written as",
    "emoji": "My favourite emoji is",
    "degrees": "Water boils at",
}


def _stream_text(client, **kwargs):
    """Concatenated text per choice index, the last finish_reason per index, and all chunks."""
    texts, finish, chunks = {}, {}, []
    for chunk in client.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.text or "")
            if choice.finish_reason is not None:
                assert choice.index not in finish, f"two finish_reasons for choice {choice.index}"
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def test_completion_basic_shape_and_usage(client, server_url, model_name, helpers):
    prompt = PROMPTS["plain"]
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0)
    assert out.object == "text_completion"
    assert out.model == model_name
    assert out.id
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len(helpers.tokenize(server_url, model_name, prompt))
    assert 1 <= out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_ignore_eos_generates_exactly_max_tokens(client, model_name):
    out = client.completions.create(
        model=model_name, prompt="Hi", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 12
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("name", list(PROMPTS), ids=list(PROMPTS))
def test_streamed_text_equals_non_streamed(client, model_name, name):
    kwargs = dict(model=model_name, prompt=PROMPTS[name], max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs)
    texts, finish, chunks = _stream_text(client, **kwargs)
    assert texts == {0: full.choices[0].text}
    assert finish == {0: full.choices[0].finish_reason}
    assert len(chunks) >= 2, "a 24-token answer arrived in a single chunk: not streamed"
    assert all(c.usage is None for c in chunks), "usage sent without stream_options.include_usage"


def test_prompt_as_token_ids_equals_prompt_as_text(client, server_url, model_name, helpers):
    prompt = PROMPTS["plain"]
    ids = helpers.tokenize(server_url, model_name, prompt)
    by_text = client.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_list_of_prompts_gives_one_choice_each(client, model_name):
    prompts = [PROMPTS["plain"], PROMPTS["code"]]
    batch = client.completions.create(model=model_name, prompt=prompts, max_tokens=8, temperature=0)
    assert sorted(c.index for c in batch.choices) == [0, 1]
    by_index = {c.index: c.text for c in batch.choices}
    singles = [client.completions.create(model=model_name, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    assert by_index == {i: s.choices[0].text for i, s in enumerate(singles)}
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_n3_seeded_samples_are_distinct_indexed_and_counted(client, model_name):
    kwargs = dict(model=model_name, prompt="Tell me a story about a dragon.", max_tokens=16,
                  temperature=1.0, n=3, seed=1234, logprobs=0)
    out = client.completions.create(**kwargs)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3, texts
    per_choice = [len(c.logprobs.tokens) for c in out.choices]
    assert out.usage.completion_tokens == sum(per_choice)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    again = client.completions.create(**kwargs)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts, "seeded n=3 is not reproducible"


def test_n3_seeded_stream_matches_non_stream_and_counts_usage(client, model_name):
    kwargs = dict(model=model_name, prompt="Tell me a story about a dragon.", max_tokens=16,
                  temperature=1.0, n=3, seed=1234)
    full = client.completions.create(**kwargs)
    texts, finish, chunks = _stream_text(client, stream_options={"include_usage": True}, **kwargs)
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


# ---- stop strings -------------------------------------------------------------------------


def _two_token_stop(server_url, model_name, helpers, text):
    """A 4-character stop string: 2 chars at the end of one token + 2 at the start of the next."""
    ids = helpers.tokenize(server_url, model_name, text)
    # character offset of every token boundary, from decoding growing prefixes
    bounds = [len(helpers.detokenize(server_url, model_name, ids[:k])) for k in range(len(ids) + 1)]
    assert helpers.detokenize(server_url, model_name, ids) == text
    for k in range(2, len(ids) - 1):
        b = bounds[k]
        if b - bounds[k - 1] < 2 or bounds[k + 1] - b < 2:
            continue
        stop = text[b - 2:b + 2]
        if not stop.replace(" ", "").isalpha() or text.find(stop) != b - 2 or b - 2 < 4:
            continue
        if helpers.detokenize(server_url, model_name, ids[:k]) != text[:b]:
            continue
        return stop, b - 2
    pytest.fail(f"no two-token stop string found in {text!r} (tokens {ids})")


@pytest.fixture(scope="module")
def story(client, model_name):
    kwargs = dict(model=model_name, prompt=PROMPTS["plain"], max_tokens=24, temperature=0)
    return kwargs, client.completions.create(**kwargs).choices[0].text


def test_stop_string_spanning_two_tokens(client, server_url, model_name, helpers, story):
    kwargs, text = story
    stop, at = _two_token_stop(server_url, model_name, helpers, text)
    out = client.completions.create(stop=[stop], **kwargs)
    assert out.choices[0].text == text[:at], (stop, text)
    assert out.choices[0].finish_reason == "stop"
    texts, finish, _ = _stream_text(client, stop=[stop], **kwargs)
    assert texts == {0: text[:at]}, f"streamed text with stop {stop!r} differs"
    assert finish == {0: "stop"}


def test_earliest_of_several_stop_strings_wins(client, model_name, story):
    kwargs, text = story
    words = [w for w in text.split() if len(w) >= 4 and w.isalpha()]
    early, late = words[1], words[-1]
    assert 0 < text.find(early) < text.find(late), (early, late, text)
    out = client.completions.create(stop=[late, early], **kwargs)
    assert out.choices[0].text == text[:text.find(early)]
    assert out.choices[0].finish_reason == "stop"


def test_stop_as_a_single_string(client, model_name, story):
    kwargs, text = story
    word = [w for w in text.split() if len(w) >= 4 and w.isalpha()][2]
    out = client.completions.create(stop=word, **kwargs)
    assert out.choices[0].text == text[:text.find(word)]
    assert out.choices[0].finish_reason == "stop"


def test_stop_string_never_matched_runs_to_length(client, model_name, story):
    kwargs, text = story
    out = client.completions.create(stop=["@@never@@"], **kwargs)
    assert out.choices[0].text == text
    assert out.choices[0].finish_reason == "length"


# ---- logprobs and echo --------------------------------------------------------------------


def test_logprobs_2_shape_and_greedy_consistency(client, model_name):
    prompt = PROMPTS["plain"]
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    choice = out.choices[0]
    lp = choice.logprobs
    n = out.usage.completion_tokens
    assert n >= 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(logprob, float) and math.isfinite(logprob) and logprob <= 0.0
        assert 1 <= len(top) <= 3, top  # the 2 best, plus the sampled token if it is not among them
        assert all(v <= 0.0 for v in top.values())
        # greedy: the sampled token is the most likely one
        assert token in top, (token, top)
        assert logprob == pytest.approx(max(top.values()), abs=1e-3)


def test_logprobs_0_gives_only_the_sampled_token(client, model_name):
    out = client.completions.create(model=model_name, prompt=PROMPTS["plain"], max_tokens=4, temperature=0, logprobs=0)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(isinstance(v, float) and v <= 0.0 for v in lp.token_logprobs)


def test_echo_with_max_tokens_0_returns_the_prompt(client, model_name):
    prompt = "The quick brown fox jumps over the lazy dog."
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=0, echo=True)
    assert out.choices[0].text == prompt
    assert out.usage.completion_tokens == 0
    assert out.usage.total_tokens == out.usage.prompt_tokens


def test_echo_prepends_the_prompt_to_the_completion(client, model_name):
    prompt = PROMPTS["plain"]
    plain = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=0)
    echoed = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text


def test_echo_logprobs_max_tokens_0_returns_prompt_logprobs(client, model_name):
    """What perplexity / lm-eval clients send: the logprob of every prompt token."""
    prompt = "The quick brown fox jumps over the lazy dog."
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt
    lp = choice.logprobs
    n = out.usage.prompt_tokens
    assert out.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == prompt
    assert lp.text_offset[0] == 0
    # OpenAI's shape: nothing predicts the first token
    assert lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert isinstance(logprob, float) and math.isfinite(logprob) and logprob <= 0.0
        assert isinstance(top, dict) and 1 <= len(top) <= 2
    # a well-known sentence: once it has started, the model finds it likely (" quick" after
    # "The" has no way to be likely: -14.3 here, as in the Hugging Face forward pass)
    assert sum(lp.token_logprobs[2:]) / (n - 2) > -4.0


# ---- usage in streams ---------------------------------------------------------------------


def test_include_usage_sends_one_final_usage_chunk(client, server_url, model_name, helpers):
    prompt = PROMPTS["code"]
    kwargs = dict(model=model_name, prompt=prompt, max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs)
    _, _, chunks = _stream_text(client, stream_options={"include_usage": True}, **kwargs)
    *body, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == full.usage.prompt_tokens == len(helpers.tokenize(server_url, model_name, prompt))
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert body and all(c.usage is None for c in body)


def test_without_include_usage_no_chunk_has_usage(client, model_name):
    _, _, chunks = _stream_text(client, model=model_name, prompt=PROMPTS["code"], max_tokens=6, temperature=0)
    assert chunks and all(c.usage is None for c in chunks)

"""/v1/completions with echo + logprobs: the prompt tokens' logprobs in front of the generated ones.

The reference is a Hugging Face forward pass over the same model folder in float32 (the
test server runs float32 too, see conftest).
"""

import math

import pytest

SENTENCE = "The history of tea spans several millennia and many cultures."
# Several KV blocks (16 tokens each) of text, for the prefix cache to have something to reuse.
LONG_PROMPT = (
    "Tea is an aromatic beverage prepared by pouring hot or boiling water over cured or fresh "
    "leaves of Camellia sinensis, an evergreen shrub native to East Asia which probably "
    "originated in the borderlands of south-western China and northern Myanmar."
)


@pytest.fixture(scope="module")
def hf(default_model_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(default_model_path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path))

    class HF:
        @staticmethod
        def prompt_logprobs(text: str):
            """(token ids, log_softmax of the logits [num_tokens, vocab]) for `text`."""
            ids = tokenizer.encode(text)
            with torch.inference_mode():
                logits = model(torch.tensor([ids])).logits[0].float()
            return ids, torch.log_softmax(logits, dim=-1)

        @staticmethod
        def token_text(token_id: int) -> str:
            return tokenizer.decode([token_id])

    return HF


def _echo(client, model_name, prompt, **kwargs):
    kwargs = {"max_tokens": 0, "logprobs": 1, **kwargs}
    return client.completions.create(model=model_name, prompt=prompt, echo=True, temperature=0, **kwargs)


def _assert_offsets_follow_tokens(lp):
    offset = 0
    for token, text_offset in zip(lp.tokens, lp.text_offset):
        assert text_offset == offset
        offset += len(token)


@pytest.mark.parametrize("k", [0, 2, 5], ids=["logprobs-0", "logprobs-2", "logprobs-5"])
def test_prompt_logprobs_equal_hugging_face(client, model_name, server_url, helpers, hf, k):
    ids, expected = hf.prompt_logprobs(SENTENCE)
    assert helpers.tokenize(server_url, model_name, SENTENCE) == ids
    out = _echo(client, model_name, SENTENCE, logprobs=k)
    lp = out.choices[0].logprobs
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        row = expected[pos - 1]
        assert lp.token_logprobs[pos] == pytest.approx(row[ids[pos]].item(), abs=1e-3), f"position {pos}"
        top = lp.top_logprobs[pos]
        # the prompt token plus the k most likely ones (k when the prompt token is among them)
        assert len(top) in (k, k + 1), f"position {pos}: {top}"
        assert top[lp.tokens[pos]] == pytest.approx(lp.token_logprobs[pos], abs=1e-6)
        values, indices = row.topk(k)
        for value, token_id in zip(values.tolist(), indices.tolist()):
            text = hf.token_text(token_id)
            assert top[text] == pytest.approx(value, abs=1e-3), f"position {pos}, top token {text!r}"


def test_echo_logprobs_continue_into_the_completion(client, model_name):
    """Prompt entries first, then the generated ones: the same as without echo, offsets shifted."""
    plain = client.completions.create(model=model_name, prompt=SENTENCE, max_tokens=6, temperature=0, logprobs=2)
    echoed = _echo(client, model_name, SENTENCE, max_tokens=6, logprobs=2)
    choice, lp = echoed.choices[0], echoed.choices[0].logprobs
    generated = plain.choices[0].logprobs
    num_prompt = echoed.usage.prompt_tokens
    assert choice.text == SENTENCE + plain.choices[0].text
    assert len(lp.tokens) == num_prompt + plain.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset[0] == 0
    _assert_offsets_follow_tokens(lp)
    assert lp.tokens[num_prompt:] == generated.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(generated.token_logprobs, abs=1e-5)
    assert [set(t) for t in lp.top_logprobs[num_prompt:]] == [set(t) for t in generated.top_logprobs]
    assert all(isinstance(v, float) and math.isfinite(v) for v in lp.token_logprobs[1:])


def test_streamed_echo_logprobs_equal_non_streamed(client, model_name):
    kwargs = dict(model=model_name, prompt=[SENTENCE, "Water boils at"], max_tokens=5, temperature=0,
                  echo=True, logprobs=1, n=2)
    full = client.completions.create(**kwargs)
    texts, tokens, token_logprobs, offsets, first_chunks = {}, {}, {}, {}, {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            first_chunks.setdefault(c.index, c)
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                token_logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
                offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
    assert sorted(texts) == [0, 1, 2, 3]
    for choice in full.choices:
        i = choice.index
        prompt = SENTENCE if i < 2 else "Water boils at"
        # the first chunk of each choice carries the whole echoed prompt and its logprobs
        first = first_chunks[i]
        assert first.text.startswith(prompt)
        assert "".join(first.logprobs.tokens).startswith(prompt)
        assert first.logprobs.token_logprobs[0] is None
        assert texts[i] == choice.text
        assert tokens[i] == choice.logprobs.tokens
        assert offsets[i] == choice.logprobs.text_offset
        assert token_logprobs[i][0] is None and choice.logprobs.token_logprobs[0] is None
        assert token_logprobs[i][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)


def test_token_id_prompt_echoes_its_decoded_tokens(client, model_name, server_url, helpers):
    ids = helpers.tokenize(server_url, model_name, SENTENCE)
    by_text = _echo(client, model_name, SENTENCE)
    by_ids = _echo(client, model_name, ids)
    assert by_ids.choices[0].text == SENTENCE
    assert by_ids.choices[0].logprobs.tokens == by_text.choices[0].logprobs.tokens
    assert by_ids.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        by_text.choices[0].logprobs.token_logprobs[1:], abs=1e-5
    )


def test_repeated_prompt_gives_complete_prompt_logprobs(client, model_name, hf):
    """The second request could reuse the first one's cached KV blocks; its logprobs must
    still cover every prompt token (a cached position computes no logits)."""
    ids, expected = hf.prompt_logprobs(LONG_PROMPT)
    assert len(ids) >= 32
    first = _echo(client, model_name, LONG_PROMPT)
    second = _echo(client, model_name, LONG_PROMPT)
    for out in (first, second):
        lp = out.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids)
        reference = [expected[pos - 1, ids[pos]].item() for pos in range(1, len(ids))]
        assert lp.token_logprobs[1:] == pytest.approx(reference, abs=1e-3)

"""Continuous batching must not change greedy answers: 16 at once == 16 one by one."""

import asyncio

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "In Japanese, 'thank you' is written as",
    "Water boils at",
    "List of fruits: apple, banana,",
    "The French word for coffee is",
    "1, 2, 3, 4,",
    "Dear Sir or Madam,",
    "The quick brown fox",
    "import numpy as np\n",
    "Q: What is 2+2?\nA:",
    "My favourite emoji is",
    "Paris is known for its long history of art, music, food and science. In the morning",
    "The speed of light is",
]
# varied lengths, so requests finish (and free their slots) at different steps
MAX_TOKENS = [24, 17, 24, 9, 24, 20, 24, 13, 24, 24, 5, 24, 19, 24, 24, 11]


def _request(model, i):
    return dict(model=model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0)


def test_16_concurrent_greedy_equal_sequential(async_client_factory, model_name):
    async def one_by_one():
        async with async_client_factory() as client:
            return [await client.completions.create(**_request(model_name, i)) for i in range(len(PROMPTS))]

    async def all_at_once():
        async with async_client_factory() as client:
            return await asyncio.gather(*(client.completions.create(**_request(model_name, i)) for i in range(len(PROMPTS))))

    sequential = asyncio.run(one_by_one())
    concurrent = asyncio.run(all_at_once())
    for i, (seq, conc) in enumerate(zip(sequential, concurrent)):
        assert conc.choices[0].text == seq.choices[0].text, f"prompt {i} ({PROMPTS[i]!r})"
        assert conc.choices[0].finish_reason == seq.choices[0].finish_reason, f"prompt {i}"
        assert conc.usage.completion_tokens == seq.usage.completion_tokens, f"prompt {i}"


def test_concurrent_streams_and_chats_equal_sequential(async_client_factory, model_name):
    """Streamed completions and chat requests mixed in one batch, against one-by-one answers."""

    messages = [[{"role": "user", "content": p}] for p in PROMPTS[:4]]

    async def stream_text(client, **kwargs):
        text = ""
        async for chunk in await client.completions.create(stream=True, **kwargs):
            text += "".join(c.text for c in chunk.choices)
        return text

    async def chat_text(client, msgs):
        out = await client.chat.completions.create(model=model_name, messages=msgs, max_tokens=16, temperature=0)
        return out.choices[0].message.content

    async def run(concurrently: bool):
        async with async_client_factory() as client:
            jobs = [lambda i=i: stream_text(client, **_request(model_name, i)) for i in range(4, 8)]
            jobs += [lambda m=m: chat_text(client, m) for m in messages]
            if concurrently:
                return list(await asyncio.gather(*(job() for job in jobs)))
            return [await job() for job in jobs]

    sequential = asyncio.run(run(False))
    concurrent = asyncio.run(run(True))
    assert concurrent == sequential

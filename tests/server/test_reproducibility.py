"""Same request, same tokens, through the real server with its defaults in bf16 (batch-invariant
without a flag; the start-up log says so): the issue's
two reproductions (the same chat request three times, cold then from the prefix cache; 16
completions one by one and the same 16 at once), streamed vs not, and seeded sampling beside
other traffic. Text and every logprob must be equal, bit for bit (JSON floats round-trip).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(),
                                reason="the invariant bf16 kernels need AVX512-BF16")

CHAT = dict(messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a large ocean."}],
            max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)


@pytest.fixture(scope="module")
def bf16_url(start_server) -> str:
    # bf16 (what --dtype auto is on an AVX512-BF16 CPU; the test servers otherwise fix float32),
    # no other flag: batch invariance is the default.
    server = start_server(["--dtype", "bfloat16"])
    assert "[pagoda] batch_invariant: on" in server.log_path.read_text(errors="replace")
    return server.url


def chat_result(body: dict) -> tuple:
    choice = body["choices"][0]
    return choice["message"]["content"], [(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
                                          for t in choice["logprobs"]["content"]]


def completion_result(choice: dict) -> tuple:
    return choice["text"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]


def test_the_same_chat_request_three_times(bf16_url):
    """Cold, then twice with the prompt in the prefix cache (its tail computed in a shorter chunk)."""
    bodies = []
    for _ in range(3):
        r = httpx.post(f"{bf16_url}/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200, r.text
        bodies.append(r.json())
    assert bodies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert chat_result(bodies[0]) == chat_result(bodies[1]) == chat_result(bodies[2])


PROMPTS = [f"Question {i}: what is special about the number {i}? Answer:" for i in range(16)]


def test_sixteen_completions_one_by_one_vs_all_at_once(bf16_url):
    def body(prompt: str, **extra) -> dict:
        return dict(prompt=prompt, max_tokens=24, temperature=0, logprobs=2, **extra)

    alone = []
    for prompt in PROMPTS:
        r = httpx.post(f"{bf16_url}/v1/completions", json=body(prompt), timeout=60)
        assert r.status_code == 200, r.text
        alone.append(completion_result(r.json()["choices"][0]))

    async def together() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            rs = await asyncio.gather(*(client.post(f"{bf16_url}/v1/completions", json=body(p)) for p in PROMPTS))
        assert all(r.status_code == 200 for r in rs)
        return [r.json() for r in rs]

    batched = [completion_result(b["choices"][0]) for b in asyncio.run(together())]
    # One request holding all 16 prompts (one engine batch from its first step).
    r = httpx.post(f"{bf16_url}/v1/completions", json=body(PROMPTS), timeout=120)
    assert r.status_code == 200, r.text
    listed = [completion_result(c) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    for i in range(len(PROMPTS)):
        assert batched[i] == alone[i], f"prompt {i} alone vs concurrent"
        assert listed[i] == alone[i], f"prompt {i} alone vs in one request's batch"


def test_streamed_vs_not(bf16_url, helpers):
    body = dict(CHAT, messages=[{"role": "user", "content": "Write one line about rivers."}], max_tokens=24)
    r = httpx.post(f"{bf16_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text, logprobs = chat_result(r.json())
    with httpx.stream("POST", f"{bf16_url}/v1/chat/completions", json=dict(body, stream=True), timeout=60) as s:
        chunks = [c for c in helpers.parse_sse(s.iter_lines()) if isinstance(c, dict)]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    streamed_lp = [(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
                   for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
                   for t in c["choices"][0]["logprobs"]["content"]]
    assert (streamed, streamed_lp) == (text, logprobs)


def test_seeded_sampling_alone_vs_beside_other_requests(bf16_url):
    body = dict(prompt="Once upon a time", max_tokens=24, temperature=1.0, top_p=0.9, seed=7, logprobs=1)
    r = httpx.post(f"{bf16_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    alone = completion_result(r.json()["choices"][0])

    async def beside() -> dict:
        async with httpx.AsyncClient(timeout=120) as client:
            others = [client.post(f"{bf16_url}/v1/completions",
                                  json=dict(prompt=p, max_tokens=8 + i, temperature=0.8)) for i, p in enumerate(PROMPTS[:12])]
            rs = await asyncio.gather(client.post(f"{bf16_url}/v1/completions", json=body), *others)
        assert all(x.status_code == 200 for x in rs)
        return rs[0].json()

    assert completion_result(asyncio.run(beside())["choices"][0]) == alone
    # n = 4: sample 0 is the n = 1 request's sample (the same seed).
    r = httpx.post(f"{bf16_url}/v1/completions", json=dict(body, n=4), timeout=60)
    assert r.status_code == 200, r.text
    first = next(c for c in r.json()["choices"] if c["index"] == 0)
    assert completion_result(first) == alone

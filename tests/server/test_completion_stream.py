"""The streamed echo + logprobs path on hand-made engine outputs (no server, no model).

The real engine usually hands out sample 0 first, so the order that needs holding back -
another sample before sample 0, whose output carries the prompt logprobs - is built here.
"""

import asyncio
import json
import types

from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from server.protocol import CompletionRequest
from server.serving import OpenAIServing, PromptInput
from server.serving_completion import CompletionServing

PROMPT_IDS = [10, 11, 12]
PROMPT_LOGPROBS = [None, {11: Logprob(-1.5, 2, " b"), 99: Logprob(-0.5, 1, " z")}, {12: Logprob(-0.25, 1, " c")}]


def _sample(index: int, token_ids: list[int], text: str, delta: str, finish: str | None = None) -> CompletionOutput:
    logprobs = [{t: Logprob(-0.1 * (j + 1), 1, f"<{t}>")} for j, t in enumerate(token_ids)]
    return CompletionOutput(index=index, text=text, token_ids=token_ids, logprobs=logprobs, finish_reason=finish,
                            delta_text=delta)


def _output(*samples: CompletionOutput, prompt_logprobs=None) -> RequestOutput:
    return RequestOutput("r", None, PROMPT_IDS, list(samples), prompt_logprobs=prompt_logprobs)


def _events(outputs: list[RequestOutput]) -> list[dict]:
    serving = types.SimpleNamespace(
        model_name="m",
        hidden_ids=lambda req: frozenset(),
        usage=lambda prompts, results, n: OpenAIServing.usage(None, prompts, results, n),
    )
    req = CompletionRequest.model_validate(
        {"prompt": "a b c", "echo": True, "logprobs": 1, "n": 2, "max_tokens": 2, "stream": True,
         "stream_options": {"include_usage": True}}
    )
    prompt = PromptInput(PROMPT_IDS, "a b c", SamplingParams(n=2, max_tokens=2), first_token="a")

    async def stream():
        for out in outputs:
            yield 0, out

    async def run() -> list[bytes]:
        return [e async for e in CompletionServing(serving)._stream(req, "cmpl-x", 0, [prompt], stream())]

    return [json.loads(e[len(b"data: "):]) for e in asyncio.run(run())]


def test_a_sample_ahead_of_sample_0_waits_for_the_prompt_logprobs():
    events = _events([
        _output(_sample(1, [7], "<7>", "<7>")),
        _output(_sample(1, [7, 8], "<7><8>", "<8>", "length")),
        _output(_sample(0, [5], "<5>", "<5>"), prompt_logprobs=PROMPT_LOGPROBS),
        _output(_sample(0, [5, 6], "<5><6>", "<6>", "length"), prompt_logprobs=PROMPT_LOGPROBS),
    ])
    *chunks, usage = events
    choices = [c["choices"][0] for c in chunks]
    assert [c["index"] for c in choices] == [0, 1, 0]  # sample 1 leaves only once the prompt logprobs exist
    first_0, first_1, last_0 = choices
    for first, tokens in ((first_0, ["<5>"]), (first_1, ["<7>", "<8>"])):
        assert first["text"] == "a b c" + "".join(tokens)
        lp = first["logprobs"]
        assert lp["tokens"] == ["a", " b", " c", *tokens]
        assert lp["token_logprobs"][:3] == [None, -1.5, -0.25]
        assert lp["top_logprobs"][:3] == [None, {" b": -1.5, " z": -0.5}, {" c": -0.25}]
        assert lp["text_offset"] == [0, 1, 3, 5, 8][: len(lp["tokens"])]
    assert first_1["finish_reason"] == "length"
    assert last_0["text"] == "<6>" and last_0["logprobs"]["tokens"] == ["<6>"]
    assert last_0["logprobs"]["text_offset"] == [8] and last_0["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4

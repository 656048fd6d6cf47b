"""POST /v1/completions: prompts (text or token ids) in, one choice per (prompt, sample) out.

With `echo` the prompt's text goes in front of each choice's text; with `echo` and
`logprobs` the prompt tokens' logprobs (computed by the engine as `prompt_logprobs`) go in
front of the generated ones - what perplexity / lm-eval clients send, usually with
`max_tokens: 0`. Streamed, the echoed prompt and its logprobs go in each choice's first
chunk. vLLM's `prompt_logprobs` come from the same engine computation, in vLLM's shape on
each choice; `return_token_ids` adds `prompt_token_ids` and `token_ids` to each choice (and
chunk); `truncate_prompt_tokens` keeps each prompt's last tokens (server/protocol_vllm.py).

`best_of` (> n): each prompt runs `best_of` samples through the engine's usual `n` fan-out
(sample j seeded `seed + j`, as for `n`), with the sampled tokens' logprobs asked for
internally; the `n` with the highest cumulative logprob (the sum of each sampled token's
own logprob) are returned, best first, with logprobs only when the request asked for
them. Usage counts the completion tokens of all `best_of` samples (as OpenAI bills them).
Not with `stream` (the best are known only at the end). `best_of` equal to `n` is plain `n`.
`response_format` / `structured_outputs` / `guided_*` constrain every sample
(`structured_output_spec`).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from server.errors import InternalServerError, InvalidRequestError
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    completion_logprobs,
    echo_logprobs,
    structured_output_spec,
)
from server.protocol_vllm import prompt_logprobs_out, top_entries, truncate_prompt
from server.request_id import response_id
from server.serving import (
    OpenAIServing,
    PromptInput,
    PromptResult,
    json_response,
    new_logprobs,
    prompt_entries,
    read_request,
    sse_event,
    sse_response,
)


@dataclass(slots=True)
class _ChoiceStream:
    """Where one streamed choice stands."""

    started: bool = False
    """Its first chunk (which carries the echo) went out."""
    num_logprobs_sent: int = 0
    num_token_ids_sent: int = 0
    """Output token ids sent (`return_token_ids`)."""
    text_offset: int = 0
    num_tokens: int = 0
    held_text: str = ""
    """Text not sent yet: only while the first chunk waits for the prompt's logprobs."""
    held: CompletionOutput | None = None
    """The latest output of a choice whose first chunk waits for the prompt's logprobs."""


class CompletionServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_completion(self, request: Request) -> Response:
        arrival = time.monotonic()
        serving = self.serving
        req = await read_request(request, CompletionRequest, serving.config.max_body_bytes)
        serving.check_model(req.model)
        params, samples, num_logprobs, num_prompt_logprobs = await self._prepare(req)
        admission = serving.admit(len(req.prompts) * samples, request, req.priority)
        prompts = await serving.tokenize(admission, self._tokenize, req.prompts, req.echo, params, req.truncate_prompt_tokens)
        request_id, given = response_id(request, "cmpl")
        created = int(time.time())
        stream = serving.start_streams(serving.engine_request_id(request_id, given), prompts, req.cache_salt, admission,
                                       arrival, "completions")
        as_token_ids = serving.as_token_ids(req)
        if req.stream:
            events = self._stream(req, request_id, created, prompts, stream, as_token_ids)
            return sse_response(serving.sse_events(events), admission)
        try:
            finals, results = await serving.until_disconnected(request, serving.collect(stream, len(prompts), samples))
        finally:
            admission.release_all()
        hidden_ids = serving.hidden_ids(req)
        choices = []
        # Every sample run is billed, the ones best_of drops too.
        num_completion_tokens = sum(len(c.token_ids) for outputs in finals for c in outputs)
        for i, prompt in enumerate(prompts):
            outputs = _best(finals[i], req.n) if samples > req.n else finals[i]
            for rank, c in enumerate(outputs):
                logprobs = None
                if req.logprobs is not None:
                    logprobs, offset = (_echoed_logprobs(prompt, results[i], num_logprobs, as_token_ids) if req.echo
                                        else (None, 0))
                    logprobs, _ = completion_logprobs(c.logprobs or [], offset, hidden_ids, into=logprobs,
                                                      as_token_ids=as_token_ids)
                choices.append(
                    CompletionChoice(
                        index=i * req.n + rank,
                        text=(prompt.text or "") + c.text if req.echo else c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=(None if num_prompt_logprobs is None
                                         else prompt_logprobs_out(prompt_entries(prompt, results[i]), num_prompt_logprobs)),
                        prompt_token_ids=prompt.token_ids if req.return_token_ids else None,
                        token_ids=list(c.token_ids) if req.return_token_ids else None,
                    )
                )
        response = CompletionResponse(
            id=request_id, created=created, model=req.model or serving.model_name, choices=choices,
            usage=serving.usage(prompts, results, num_completion_tokens),
        )
        return json_response(response)

    async def render_prompts(self, req: CompletionRequest) -> list[PromptInput]:
        """The prompts `create_completion` would give the engine (token ids and sampling
        params), without taking queue places: `POST /v1/completions/render`."""
        params, *_ = await self._prepare(req, count=False)
        return await self.serving.tokenizers.run(self._tokenize, req.prompts, req.echo, params,
                                                 req.truncate_prompt_tokens)

    async def _prepare(self, req: CompletionRequest, count: bool = True) -> tuple[SamplingParams, int, int | None, int | None]:
        """The request's sampling params, samples per prompt (best_of), logprobs and
        prompt_logprobs counts, its grammar compiled (a bad one is a 400)."""
        serving = self.serving
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequestError("max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens")
        num_logprobs = serving.num_logprobs(req.logprobs, "logprobs")
        num_prompt_logprobs = serving.num_logprobs(req.prompt_logprobs, "prompt_logprobs")
        # The engine computes the prompt's logprobs once, with the most alternatives echo
        # (logprobs) or prompt_logprobs asks for; each is cut to its own count.
        prompt_ks = [k for k in (num_logprobs if req.echo else None, num_prompt_logprobs) if k is not None]
        spec = structured_output_spec(req)
        params = serving.sampling_params(req, req.max_tokens, num_logprobs, max(prompt_ks, default=None),
                                         structured_output=spec)
        samples = req.samples_per_prompt
        if samples > req.n and req.use_beam_search:
            raise InvalidRequestError("best_of cannot be used with use_beam_search (n is the beam width)", param="best_of")
        if samples > req.n:
            self._check_best_of(req, samples)
            # best_of: every sample's own token logprobs rank it (the first entry of each dict).
            params = dataclasses.replace(params, n=samples, logprobs=num_logprobs or 0)
        await serving.prepare_structured_output(spec, count=count)
        return params, samples, num_logprobs, num_prompt_logprobs

    def _check_best_of(self, req: CompletionRequest, best_of: int) -> None:
        """The server's limits, named as best_of (they would otherwise blame n)."""
        max_n = self.serving.config.max_n
        if best_of > max_n:
            raise InvalidRequestError(f"best_of must be at most {max_n}, got {best_of}", param="best_of")
        limit = self.serving.engine.max_waiting_requests
        if len(req.prompts) * best_of > limit:
            raise InvalidRequestError(
                f"the request asks for {len(req.prompts) * best_of} samples (prompts x best_of) but this server queues "
                f"at most {limit}",
                param="best_of",
            )

    def _tokenize(
        self, tokenizer: Any, raw: list[str | list[int]], echo: bool, params: SamplingParams,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PromptInput]:
        serving = self.serving
        prompts = []
        for i, prompt in enumerate(raw):
            where = "prompt" if len(raw) == 1 else f"prompt {i}"
            if isinstance(prompt, str):
                token_ids, text = tokenizer.encode(prompt), prompt
            else:
                token_ids, text = list(prompt), None
                if max(token_ids) >= serving.vocab_size:
                    raise InvalidRequestError(f"{where}: token ids must be in [0, {serving.vocab_size})", param="prompt")
            kept = truncate_prompt(token_ids, truncate_prompt_tokens, serving.max_model_len)
            if echo and (text is None or len(kept) < len(token_ids)):
                # The echo shows what the model saw: the kept tokens.
                text = tokenizer.decode(kept, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            token_ids = kept
            if not token_ids:
                raise InvalidRequestError(f"{where} is empty: it tokenizes to no tokens", param="prompt")
            prompt_params = params if params.max_tokens is not None else serving.fit_open_max_tokens(token_ids, params, "prompt")
            serving.validate_prompt(token_ids, prompt_params, "prompt")
            first_token = None
            if params.prompt_logprobs is not None:
                first_token = tokenizer.decode(token_ids[:1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            prompts.append(PromptInput(token_ids, text, prompt_params, first_token))
        return prompts

    async def _stream(
        self, req: CompletionRequest, request_id: str, created: int, prompts: list[PromptInput],
        stream: AsyncIterator[tuple[int, RequestOutput]], as_token_ids: bool | None = None,
    ) -> AsyncIterator[bytes]:
        """`as_token_ids`: logprob tokens as `token_id:N` (none: as the request says)."""
        serving = self.serving
        n = req.n
        if as_token_ids is None:
            as_token_ids = bool(req.return_tokens_as_token_ids)
        choices = [_ChoiceStream() for _ in range(len(prompts) * n)]
        results = [PromptResult() for _ in prompts]
        hidden_ids = serving.hidden_ids(req)
        # Echo with logprobs: a choice's first chunk waits for its prompt's logprobs, which
        # come with sample 0's first output (another sample can come out earlier).
        needs_prompt_logprobs = req.echo and req.logprobs is not None

        def chunk(i: int, c: CompletionOutput) -> bytes | None:
            choice = choices[i * n + c.index]
            text, choice.held_text, choice.held = choice.held_text, "", None
            logprobs: CompletionLogprobs | None = None
            prompt_token_ids = token_ids = None
            if not choice.started:
                choice.started = True
                if req.echo:
                    text = (prompts[i].text or "") + text
                if needs_prompt_logprobs:
                    logprobs, choice.text_offset = _echoed_logprobs(prompts[i], results[i], req.logprobs, as_token_ids)
                if req.return_token_ids:
                    prompt_token_ids = prompts[i].token_ids
            if req.logprobs is not None:
                new = new_logprobs(c, choice.num_logprobs_sent)
                choice.num_logprobs_sent += len(new)
                if new:
                    logprobs, choice.text_offset = completion_logprobs(new, choice.text_offset, hidden_ids, into=logprobs,
                                                                       as_token_ids=as_token_ids)
            if req.return_token_ids:
                token_ids = list(c.token_ids[choice.num_token_ids_sent:])
                choice.num_token_ids_sent = len(c.token_ids)
            if not text and logprobs is None and c.finish_reason is None and not token_ids and prompt_token_ids is None:
                return None
            return sse_event(
                CompletionStreamResponse(
                    id=request_id, created=created, model=req.model or serving.model_name,
                    choices=[CompletionStreamChoice(index=i * n + c.index, text=text, logprobs=logprobs,
                                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                    prompt_token_ids=prompt_token_ids, token_ids=token_ids)],
                    # vLLM's continuous_usage_stats: this choice's tokens so far, on every chunk.
                    usage=(serving.chunk_usage(len(prompts[i].token_ids), len(c.token_ids))
                           if req.continuous_usage else None),
                )
            )

        async with aclosing(stream):
            async for i, out in stream:
                results[i].update(out)
                waiting = needs_prompt_logprobs and results[i].prompt_logprobs is None
                for c in out.outputs:
                    choice = choices[i * n + c.index]
                    choice.num_tokens = len(c.token_ids)
                    choice.held_text += c.delta_text
                    if waiting and not choice.started:
                        choice.held = c
                    elif (event := chunk(i, c)) is not None:
                        yield event
                if needs_prompt_logprobs and not waiting:
                    # The prompt's logprobs arrived: release the samples that came out before them.
                    for choice in choices[i * n : (i + 1) * n]:
                        if choice.held is not None and (event := chunk(i, choice.held)) is not None:
                            yield event
        if req.include_usage:
            yield sse_event(
                CompletionStreamResponse(
                    id=request_id, created=created, model=req.model or serving.model_name, choices=[],
                    usage=serving.usage(prompts, results, sum(c.num_tokens for c in choices)),
                )
            )


def cumulative_logprob(c: CompletionOutput) -> float:
    """The sum of the logprobs of the tokens `c` sampled (each dict's first entry)."""
    entries = (c.logprobs or [])[: len(c.token_ids)]
    return sum(next(iter(entry.values())).logprob for entry in entries)


def _best(outputs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The `n` samples with the highest cumulative logprob, best first (ties: lower index)."""
    return sorted(outputs, key=cumulative_logprob, reverse=True)[:n]


def _echoed_logprobs(
    prompt: PromptInput, result: PromptResult, k: int, as_token_ids: bool = False
) -> tuple[CompletionLogprobs, int]:
    """The prompt's logprob entries for an echo with `logprobs: k`, and the text offset after them."""
    entries = prompt_entries(prompt, result)
    if prompt.first_token is None:
        raise InternalServerError("the prompt's first token was not decoded for its echo")
    # The engine may have computed more alternatives (for prompt_logprobs): the echo shows k.
    trimmed = [None, *(top_entries(e, k) for e in entries[1:])]
    return echo_logprobs(prompt.first_token, trimmed, prompt.token_ids[0], as_token_ids)

"""POST /v1/chat/completions: messages rendered by the model's chat template, one prompt,
`n` choices. Streamed: a role chunk per choice, content chunks, then a finish chunk."""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.errors import InvalidRequestError
from server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    chat_logprobs,
)
from server.serving import (
    OpenAIServing,
    PromptInput,
    PromptResult,
    json_response,
    new_logprobs,
    read_request,
    sse_event,
    sse_response,
)


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool) -> list[int]:
    conversation = [m.for_template() for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except (jinja2.TemplateError, ValueError) as e:
        # The template's own raise_exception (e.g. "roles must alternate") and a missing template.
        raise InvalidRequestError(f"cannot apply the chat template: {e}", param="messages") from e
    # The template writes the special tokens itself.
    return tokenizer.encode(text, add_special_tokens=False)


class ChatServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_chat_completion(self, request: Request) -> Response:
        arrival = time.monotonic()
        serving = self.serving
        req = await read_request(request, ChatCompletionRequest, serving.config.max_body_bytes)
        serving.check_model(req.model)
        top_k = req.top_logprobs or 0
        params = serving.sampling_params(req, req.output_limit, top_k if req.logprobs else None)
        admission = serving.admit(req.n)
        [prompt] = await serving.tokenize(admission, self._tokenize, req, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = serving.start_streams(request_id, [prompt], req.cache_salt, admission, arrival)
        if req.stream:
            events = self._stream(req, request_id, created, prompt, stream)
            return sse_response(serving.sse_events(events), admission)
        try:
            finals, results = await serving.until_disconnected(request, serving.collect(stream, 1, req.n))
        finally:
            admission.release_all()
        choices = []
        num_completion_tokens = 0
        for c in finals[0]:
            num_completion_tokens += len(c.token_ids)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=c.text),
                    logprobs=chat_logprobs(c.logprobs or [], top_k, serving.hidden_ids(req)) if req.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=request_id, created=created, model=serving.model_name, choices=choices,
            usage=serving.usage([prompt], results, num_completion_tokens),
        )
        return json_response(response)

    def _tokenize(self, tokenizer: Any, req: ChatCompletionRequest, params: SamplingParams) -> list[PromptInput]:
        serving = self.serving
        token_ids = render_chat(tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message)
        if not token_ids:
            raise InvalidRequestError("the messages render to no tokens", param="messages")
        if params.max_tokens is None:
            params = serving.fit_open_max_tokens(token_ids, params, "messages")
        serving.validate_prompt(token_ids, params, "messages")
        return [PromptInput(token_ids, None, params)]

    async def _stream(
        self, req: ChatCompletionRequest, request_id: str, created: int, prompt: PromptInput,
        stream: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[bytes]:
        serving = self.serving
        top_k = req.top_logprobs or 0
        hidden_ids = serving.hidden_ids(req)
        num_logprobs_sent = [0] * req.n
        num_tokens = [0] * req.n
        result = PromptResult()

        def chunk(index: int, delta: dict[str, str], logprobs=None, finish_reason=None, stop_reason=None) -> bytes:
            return sse_event(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=serving.model_name,
                    choices=[ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                              finish_reason=finish_reason, stop_reason=stop_reason)],
                )
            )

        for index in range(req.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        async with aclosing(stream):
            async for _, out in stream:
                result.update(out)
                for c in out.outputs:
                    num_tokens[c.index] = len(c.token_ids)
                    logprobs = None
                    if req.logprobs:
                        new = new_logprobs(c, num_logprobs_sent[c.index])
                        num_logprobs_sent[c.index] += len(new)
                        if new:
                            logprobs = chat_logprobs(new, top_k, hidden_ids)
                    if c.delta_text or logprobs is not None:
                        yield chunk(c.index, {"content": c.delta_text}, logprobs)
                    if c.finish_reason is not None:
                        yield chunk(c.index, {}, None, c.finish_reason, c.stop_reason)
        if req.include_usage:
            yield sse_event(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=serving.model_name, choices=[],
                    usage=serving.usage([prompt], [result], sum(num_tokens)),
                )
            )

"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API over the
chat path.

A request (server/protocol_anthropic.py) becomes a chat request and goes through the chat
path's own pieces (`ChatServing.admit_prompt`: tools, grammar, sampling params, admission
and rate limits, the rendered prompt; the tool parser's stream; `OpenAIServing`'s streams,
metrics and disconnect handling), so the prefix cache, tenants and aborts behave as on
/v1/chat/completions. `max_tokens` caps the room the prompt leaves in the context: a
reply that reaches the context's end first stops with "model_context_window_exceeded"
(clients such as Claude Code send a `max_tokens` larger than a local model's context).

The reply is built from the tool parser's deltas (or plain text) by one builder
(`_Content`), whole or streamed, so the two agree: a `text` block per run of text (blank
text around tool calls is dropped), a `tool_use` block (`toolu_` id, `input` object) per
call. Streamed, the events are Anthropic's: `message_start` (sent with the first output,
when the prompt's cached tokens are known), `ping`, per block `content_block_start`,
`content_block_delta` (`text_delta` / `input_json_delta`) and `content_block_stop`, then
`message_delta` (stop_reason, stop_sequence, usage) and `message_stop`; a failure after
the headers is an `error` event. Errors before are Anthropic's envelope (server/errors.py).

Thinking (a reasoning model, server/reasoning.py; the request side is in
server/protocol_anthropic.py): the model's thinking is the reply's first block, `thinking`
(its text; empty with `display: "omitted"`) with a `signature`, streamed as `thinking_delta`
events then one `signature_delta` before its `content_block_stop`. The signature is the
SHA-256 of the thinking text (base64): an integrity tag, not Anthropic's encrypted one; a
past turn's thinking blocks are not read back (they are left out of the prompt), so it is
never checked. Thinking "enabled" on a model without a reasoning format is a 400 naming
`thinking`; with thinking off, a model whose template cannot switch it off is a 400 too.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import time
from contextlib import aclosing, contextmanager
from typing import Any, AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from engine.outputs import CompletionOutput, RequestOutput
from server.errors import (
    APIError,
    InternalServerError,
    InvalidRequestError,
    anthropic_sse_error_event,
    validation_error,
)
from server.protocol import ChatCompletionRequest
from server.protocol_anthropic import (
    CountTokensRequest,
    MessagesBase,
    MessagesRequest,
    message_object,
    messages_param,
    new_id,
    tool_input,
    usage,
)
from server.serving import OpenAIServing, PromptInput, PromptResult, read_request, sse_response
from server.serving_chat import ChatServing, ToolCallReader, render_chat, template_tools
from server.tools import ContentDelta, Delta, ToolCallDelta

ENDPOINT = "messages"


@contextmanager
def _messages_params() -> Iterator[None]:
    """Chat-path errors renamed to the Messages fields the client sent."""
    try:
        yield
    except ValidationError as e:
        error = validation_error(e.errors())
        error.param = messages_param(error.param)
        raise error from e
    except APIError as e:
        if e.param == "reasoning_effort":  # the thinking switched off (see the module docstring)
            e.message = (f"this model thinks and cannot be told not to ({e.message}): send thinking "
                         "{\"type\": \"enabled\", \"budget_tokens\": ...} or {\"type\": \"adaptive\"}")
        e.param = messages_param(e.param)
        raise


def _event(body: dict[str, Any]) -> bytes:
    return b"event: " + body["type"].encode() + b"\ndata: " + json.dumps(body).encode() + b"\n\n"


class _Content:
    """Content blocks built from the tool parser's deltas (or plain text), with the stream
    events that build them. A text block opens at the first text; with tools, blank text
    waits until text that is not blank follows it (blank text around calls is dropped)."""

    def __init__(self, tools_active: bool, show_thinking: bool = True) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._show_thinking = show_thinking
        self._thinking = ""  # the thinking block's whole text (its signature's input)
        self._drop_blank = tools_active
        self._open = False  # the last block still takes deltas
        self._blank = ""
        self._calls: dict[int, int] = {}  # parser call index -> block index
        self._arguments: dict[int, str] = {}  # block index -> the call's arguments so far

    def feed(self, deltas: list[Delta]) -> None:
        for d in deltas:
            if isinstance(d, ContentDelta):
                self._text(d.text)
            else:
                self._call(d)

    def _start(self, block: dict[str, Any]) -> int:
        self.close()
        self.blocks.append(block)
        self._open = True
        index = len(self.blocks) - 1
        self.events.append({"type": "content_block_start", "index": index, "content_block": dict(block)})
        return index

    def think(self, text: str | None) -> None:
        """The model's thinking so far: the first block (it comes before any answer)."""
        if not text:
            return
        if not (self._open and self.blocks[-1]["type"] == "thinking"):
            self._start({"type": "thinking", "thinking": "", "signature": ""})
        self._thinking += text
        if self._show_thinking:
            self.blocks[-1]["thinking"] += text
            self.events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                                "delta": {"type": "thinking_delta", "thinking": text}})

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._open and self.blocks[-1]["type"] == "text":
            index = len(self.blocks) - 1
        else:
            if self._drop_blank and not (self._blank + text).strip():
                self._blank += text
                return
            index = self._start({"type": "text", "text": ""})
            text, self._blank = self._blank + text, ""
        self.blocks[index]["text"] += text
        self.events.append({"type": "content_block_delta", "index": index,
                            "delta": {"type": "text_delta", "text": text}})

    def _call(self, d: ToolCallDelta) -> None:
        if d.name is not None:
            self._blank = ""
            self._calls[d.index] = self._start({"type": "tool_use", "id": new_id("toolu"), "name": d.name, "input": {}})
            self._arguments[self._calls[d.index]] = ""
        index = self._calls[d.index]
        if d.arguments:
            self._arguments[index] += d.arguments
            self.events.append({"type": "content_block_delta", "index": index,
                                "delta": {"type": "input_json_delta", "partial_json": d.arguments}})

    def close(self) -> None:
        """End the open block (if any): a tool_use block gets its input object."""
        if not self._open:
            return
        self._open = False
        index = len(self.blocks) - 1
        if self.blocks[index]["type"] == "tool_use":
            self.blocks[index]["input"] = tool_input(self._arguments[index])
        elif self.blocks[index]["type"] == "thinking":
            signature = base64.b64encode(hashlib.sha256(self._thinking.encode()).digest()).decode()
            self.blocks[index]["signature"] = signature
            self.events.append({"type": "content_block_delta", "index": index,
                                "delta": {"type": "signature_delta", "signature": signature}})
        self.events.append({"type": "content_block_stop", "index": index})

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


def _deltas(reader: ToolCallReader | None, c: CompletionOutput) -> list[Delta]:
    """`c`'s new text as deltas: the tool-call reader's, or plain text without tools."""
    if reader is None:
        return [ContentDelta(c.delta_text)] if c.delta_text else []
    return reader.read(c)


class MessagesServing:
    def __init__(self, serving: OpenAIServing, chat: ChatServing) -> None:
        self.serving = serving
        self.chat = chat

    def _check(self, req: MessagesBase) -> None:
        self.serving.check_model(req.model)
        if req.thinking_enabled and self.chat.reasoning is None:
            raise InvalidRequestError("thinking is not supported: this model has no reasoning format "
                                      "(--reasoning-parser); send thinking {\"type\": \"disabled\"}, or leave it out",
                                      param="thinking")

    # ---- POST /v1/messages --------------------------------------------------------------------
    async def create_message(self, request: Request) -> Response:
        arrival = time.monotonic()
        serving = self.serving
        req = await read_request(request, MessagesRequest, serving.config.max_body_bytes)
        self._check(req)
        with _messages_params():
            chat_req = ChatCompletionRequest.model_validate({**req.to_chat_request(), "model": req.model})  # its adapter, if any
            tools, admission, prompt = await self.chat.admit_prompt(chat_req, request)
        # The chat path gave the request all the room its prompt leaves; max_tokens caps it.
        prompt.params = dataclasses.replace(prompt.params, max_tokens=min(prompt.params.max_tokens, req.max_tokens))
        message_id = new_id("msg")
        stream = serving.start_streams(message_id, [prompt], None, admission, arrival, ENDPOINT)
        reader = self.chat.tool_call_reader(tools, message_id, 0) if tools.active else None
        if req.stream:
            events = self._stream(req, message_id, prompt, reader, stream)
            return sse_response(serving.sse_events(events, done=b"", error_event=anthropic_sse_error_event), admission)
        on_output = (lambda _, c: reader.read(c)) if reader is not None else None
        try:
            finals, results = await serving.until_disconnected(request, serving.collect(stream, 1, 1, on_output))
        finally:
            admission.release_all()
        c = finals[0][0]
        content = _Content(tools_active=reader is not None, show_thinking=_show_thinking(req))
        content.think(c.reasoning_text)
        content.feed(reader.deltas if reader is not None else [ContentDelta(c.text)] if c.text else [])
        content.close()
        stop_reason, stop_sequence = _stop_reason(req, reader, c)
        return JSONResponse(message_object(message_id, req.model, content.blocks, stop_reason, stop_sequence,
                                           self._usage(prompt, results[0], c)))

    async def _stream(
        self, req: MessagesRequest, message_id: str, prompt: PromptInput, reader: ToolCallReader | None,
        stream: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[bytes]:
        content = _Content(tools_active=reader is not None, show_thinking=_show_thinking(req))
        result = PromptResult()
        last: CompletionOutput | None = None
        async with aclosing(stream):
            async for _, out in stream:
                result.update(out)
                for c in out.outputs:
                    if last is None:  # the first output: the prompt's cached tokens are known now
                        start = message_object(message_id, req.model, [], None, None,
                                               self._usage(prompt, result, c))
                        yield _event({"type": "message_start", "message": start})
                        yield _event({"type": "ping"})
                    last = c
                    content.think(c.delta_reasoning_text)  # a step's thinking comes before its answer
                    content.feed(_deltas(reader, c))
                for body in content.take_events():
                    yield _event(body)
        assert last is not None  # an engine stream that ends has a final output
        stop_reason, stop_sequence = _stop_reason(req, reader, last)
        content.close()
        for body in content.take_events():
            yield _event(body)
        yield _event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                      "usage": self._usage(prompt, result, last)})
        yield _event({"type": "message_stop"})

    def _usage(self, prompt: PromptInput, result: PromptResult, c: CompletionOutput) -> dict[str, Any]:
        return usage(len(prompt.token_ids), result.num_cached_tokens, len(c.token_ids))

    # ---- POST /v1/messages/count_tokens ---------------------------------------------------------
    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens, rendered exactly as /v1/messages renders them for prefill."""
        serving = self.serving
        req = await read_request(request, CountTokensRequest, serving.config.max_body_bytes)
        self._check(req)
        with _messages_params():
            chat_req = ChatCompletionRequest.model_validate({**req.to_chat_request(), "model": req.model})  # its adapter, if any
            tools = template_tools(chat_req.effective_tools) if chat_req.effective_tool_choice != "none" else None
            token_ids = await serving.tokenizers.run(
                render_chat, chat_req.messages, chat_req.add_generation_prompt, chat_req.continue_final_message,
                tools, self.chat.chat_template, self.chat.template_kwargs(chat_req))
        return JSONResponse({"input_tokens": len(token_ids)})


def _show_thinking(req: MessagesRequest) -> bool:
    """False for `display: "omitted"`: the thinking block comes with its signature, empty."""
    return req.thinking is None or req.thinking.display != "omitted"


def _stop_reason(req: MessagesRequest, reader: ToolCallReader | None, c: CompletionOutput) -> tuple[str, str | None]:
    """Anthropic's stop_reason (and the stop sequence met) for the engine's finish."""
    reason = c.finish_reason
    if reason == "abort":  # the engine ended it: a shutdown past its grace, a grammar that failed
        detail = f": {c.stop_reason}" if isinstance(c.stop_reason, str) else ""
        raise InternalServerError(f"the request was aborted before it finished{detail}")
    if reader is not None and reader.finish_reason(reason) == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return ("max_tokens" if len(c.token_ids) >= req.max_tokens else "model_context_window_exceeded"), None
    if isinstance(c.stop_reason, str) and c.stop_reason in (req.stop_sequences or []):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


__all__ = ["ENDPOINT", "MessagesServing"]

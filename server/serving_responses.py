"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the OpenAI Responses API over the
chat path.

A request (server/protocol_responses.py) becomes a chat request: the stored conversation of
`previous_response_id`, then its input items, rendered by the chat template with its tools;
`text.format` and `tool_choice` become the chat path's grammar. Errors the chat path raises
name the Responses fields instead (`responses_param`).

The model's reply is read by the `--tool-call-parser` stream into output items, whole or
streamed the same way (`_Output`): a `message` item with one `output_text` part for text,
a `function_call` item per call. Streamed, every step is a typed SSE event with a
`sequence_number`, in OpenAI's order: `response.created`, `response.in_progress`, then per
item `output_item.added`, (`content_part.added`, `output_text.delta`...,
`output_text.done`, `content_part.done`) or (`function_call_arguments.delta`...,
`function_call_arguments.done`), `output_item.done`, and last `response.completed`,
`response.incomplete` (max_output_tokens) or `response.failed`. There is no `[DONE]`.

A reasoning model's thinking (server/reasoning.py) comes first, as a `reasoning` item whose
one `reasoning_text` part holds it whole (no summary is written), streamed as
`content_part.added`, `reasoning_text.delta`..., `reasoning_text.done`, `content_part.done`.

With `store` (the default) a finished response and its conversation go into the bounded
store (server/response_store.py) under the caller's owner, before the last event is sent.
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing, contextmanager
from typing import Any, AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from engine.outputs import CompletionOutput, RequestOutput
from server.errors import APIError, InvalidRequestError, to_api_error, validation_error
from server.protocol import ChatCompletionRequest
from server.protocol_responses import (
    ResponsesRequest,
    as_input_item,
    finish,
    function_call_item,
    message_item,
    new_id,
    output_text_part,
    reasoning_item,
    reasoning_text_part,
    response_object,
    responses_param,
    usage,
)
from server.response_store import ANONYMOUS, ResponseStore, StoredResponse
from server.serving import OpenAIServing, PromptInput, PromptResult, read_request, sse_response
from server.serving_chat import ChatServing, ToolCallReader
from server.tools import ContentDelta, ToolCallDelta

ENDPOINT = "responses"
OWNER_STATE = "api_key_owner"
"""The key in the ASGI scope's state where the auth middleware puts the caller's owner id."""


def request_owner(request: Request) -> str:
    """Who the request acts for: the owner id of the API key it was authenticated with."""
    return request.scope.get("state", {}).get(OWNER_STATE, ANONYMOUS)


@contextmanager
def _responses_params() -> Iterator[None]:
    """Chat-path errors renamed to the Responses fields the client sent."""
    try:
        yield
    except ValidationError as e:
        error = validation_error(e.errors())
        error.param = responses_param(error.param)
        raise error from e
    except APIError as e:
        e.param = responses_param(e.param)
        raise


class _Output:
    """Output items built from the tool parser's deltas (or plain text), with the stream
    events that build them. Without tools there is always one message item, opened first;
    with tools a message item opens at the first text that is not blank (blank text around
    calls is dropped), and a reply with neither text nor calls is one empty message."""

    def __init__(self, always_message: bool, thinking: bool = False) -> None:
        self.items: list[dict[str, Any]] = []
        self.done: list[bool] = []
        self._blank = ""
        self._calls: dict[int, int] = {}  # parser call index -> output index
        self._always_message = always_message
        # A thinking model's message opens after its reasoning item, at its first text.
        self.events: list[dict[str, Any]] = self._open_message() if always_message and not thinking else []

    def reasoning(self, text: str) -> None:
        """Thinking text: into the reasoning item, opened at the first."""
        if not text:
            return
        index = self._open("reasoning")
        if index is None:
            item = reasoning_item(new_id("rs"), "", "in_progress")
            self.items.append(item)
            self.done.append(False)
            index = len(self.items) - 1
            self.events += [
                {"type": "response.output_item.added", "output_index": index, "item": {**_copy(item), "content": []}},
                {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "part": reasoning_text_part("")}]
        item = self.items[index]
        item["content"][0]["text"] += text
        self.events.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": index,
                            "content_index": 0, "delta": text})

    def _has_message(self) -> bool:
        return any(item["type"] == "message" for item in self.items)

    def _open_message(self) -> list[dict[str, Any]]:
        item = message_item(new_id("msg"), "", "in_progress")
        self.items.append(item)
        self.done.append(False)
        index = len(self.items) - 1
        # As OpenAI: the item is announced without parts, then its one part is added.
        return [{"type": "response.output_item.added", "output_index": index, "item": {**_copy(item), "content": []}},
                {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "part": output_text_part("")}]

    def _open(self, kind: str) -> int | None:
        index = len(self.items) - 1
        return index if self.items and not self.done[-1] and self.items[-1]["type"] == kind else None

    def feed(self, deltas: list[ContentDelta | ToolCallDelta]) -> None:
        for d in deltas:
            if isinstance(d, ContentDelta):
                self._text(d.text)
            else:
                self._call(d)

    def _text(self, text: str) -> None:
        index = self._open("message")
        if index is None and self._always_message and not self._has_message():
            self.close_last("completed")  # the thinking before it
            self.events += self._open_message()
            index = len(self.items) - 1
        if index is None:
            if not (self._blank + text).strip():
                self._blank += text
                return
            self.close_last("completed")
            self.events += self._open_message()
            index = len(self.items) - 1
            text, self._blank = self._blank + text, ""
        item = self.items[index]
        item["content"][0]["text"] += text
        if text:
            self.events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": index,
                                "content_index": 0, "delta": text, "logprobs": []})

    def _call(self, d: ToolCallDelta) -> None:
        if d.name is not None:
            self.close_last("completed")
            self._blank = ""
            item = function_call_item(new_id("fc"), d.id or new_id("call"), d.name, "", "in_progress")
            self.items.append(item)
            self.done.append(False)
            self._calls[d.index] = len(self.items) - 1
            self.events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                                "item": _copy(item)})
        index = self._calls[d.index]
        item = self.items[index]
        item["arguments"] += d.arguments
        if d.arguments:
            self.events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                                "output_index": index, "delta": d.arguments})

    def close_last(self, status: str) -> None:
        """Finish the open item (if any) with `status`, emitting its done events."""
        if not self.items or self.done[-1]:
            return
        index = len(self.items) - 1
        item = self.items[index]
        item["status"] = status
        self.done[index] = True
        if item["type"] == "message":
            part = item["content"][0]
            base = {"item_id": item["id"], "output_index": index, "content_index": 0}
            self.events += [{"type": "response.output_text.done", **base, "text": part["text"], "logprobs": []},
                            {"type": "response.content_part.done", **base, "part": _copy(part)}]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            base = {"item_id": item["id"], "output_index": index, "content_index": 0}
            self.events += [{"type": "response.reasoning_text.done", **base, "text": part["text"]},
                            {"type": "response.content_part.done", **base, "part": _copy(part)}]
        else:
            self.events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                                "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        self.events.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})

    def finish(self, finish_reason: str | None) -> list[dict[str, Any]]:
        """Close the reply: the output items (an empty message when there is nothing)."""
        if not self.items or (self._always_message and not self._has_message()) or self._open("reasoning") is not None:
            # After thinking that never ended or nothing but thinking: the (empty) answer.
            self.close_last("incomplete" if finish_reason == "length" else "completed")
            self.events += self._open_message()
        self.close_last("incomplete" if finish_reason == "length" else "completed")
        return self.items

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    # Events carry snapshots: the items keep growing after an event is built.
    return json.loads(json.dumps(value))


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, chat: ChatServing, store: ResponseStore) -> None:
        self.serving = serving
        self.chat = chat
        self.store = store

    def _store_gauges(self) -> None:
        self.serving.metrics.set_response_store(len(self.store), self.store.num_bytes)

    # ---- POST /v1/responses ----------------------------------------------------------------
    async def create_response(self, request: Request) -> Response:
        arrival = time.monotonic()
        serving = self.serving
        req = await read_request(request, ResponsesRequest, serving.config.max_body_bytes)
        serving.check_model(req.model)
        if req.reasoning is not None and req.reasoning.is_set and self.chat.reasoning is None:
            raise InvalidRequestError("this model has no reasoning mode (the server has no --reasoning-parser for it)",
                                      param="reasoning")
        owner = request_owner(request)
        conversation = list(req.items)
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id, owner, param="previous_response_id")
            conversation = previous.conversation + conversation
        with _responses_params():
            chat_req = ChatCompletionRequest.model_validate({**req.to_chat_request(conversation), "model": req.model})
            tools, admission, prompt = await self.chat.admit_prompt(chat_req, request)
        response_id = new_id("resp")
        response = response_object(req, response_id, req.model or serving.model_name)
        stream = serving.start_streams(response_id, [prompt], None, admission, arrival, ENDPOINT)
        reader = self.chat.tool_call_reader(tools, response_id, 0) if tools.active else None
        record = (req, owner, conversation)
        if req.stream:
            events = self._stream(response, record, prompt, reader, stream)
            return sse_response(serving.sse_events(events, done=b"", error_event=_error_event), admission)
        on_output = (lambda _, c: reader.read(c)) if reader is not None else None
        try:
            finals, results = await serving.until_disconnected(request, serving.collect(stream, 1, 1, on_output))
        finally:
            admission.release_all()
        c = finals[0][0]
        output = _Output(always_message=reader is None, thinking=self.chat.reasoning is not None)
        output.reasoning(c.reasoning_text or "")
        output.feed(reader.deltas if reader is not None else [ContentDelta(c.text)] if c.text else [])
        finish_reason = _finish_reason(reader, c)
        items = output.finish(finish_reason)
        response = finish(response, finish_reason, items, self._usage(prompt, results[0], c))
        self._keep(response, record)
        return JSONResponse(response)

    async def _stream(
        self, response: dict[str, Any], record: tuple[ResponsesRequest, str, list[dict[str, Any]]],
        prompt: PromptInput, reader: ToolCallReader | None, stream: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[bytes]:
        sequence = iter(range(1 << 62))

        def event(body: dict[str, Any]) -> bytes:
            body["sequence_number"] = next(sequence)
            return b"event: " + body["type"].encode() + b"\ndata: " + json.dumps(body).encode() + b"\n\n"

        yield event({"type": "response.created", "response": response})
        yield event({"type": "response.in_progress", "response": response})
        output = _Output(always_message=reader is None, thinking=self.chat.reasoning is not None)
        result = PromptResult()
        last: CompletionOutput | None = None
        try:
            async with aclosing(stream):
                async for _, out in stream:
                    result.update(out)
                    for c in out.outputs:
                        last = c
                        output.reasoning(c.delta_reasoning_text)
                        output.feed(_deltas(reader, c))
                    for body in output.take_events():
                        yield event(body)
        except Exception as e:  # noqa: BLE001 - after the headers an error can only be an event
            error = to_api_error(e)
            failed = {**response, "status": "failed", "output": output.items,
                      "error": {"code": error.code or error.error_type, "message": error.message}}
            yield event({"type": "response.failed", "response": failed})
            return
        assert last is not None  # an engine stream that ends has a final output
        finish_reason = _finish_reason(reader, last)
        items = output.finish(finish_reason)
        for body in output.take_events():
            yield event(body)
        final = finish(response, finish_reason, items, self._usage(prompt, result, last))
        self._keep(final, record)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(final["status"],
                                                                                          "response.failed")
        yield event({"type": kind, "response": final})

    def _usage(self, prompt: PromptInput, result: PromptResult, c: CompletionOutput) -> dict[str, Any]:
        u = self.serving.usage([prompt], [result], len(c.token_ids))
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        return usage(u.prompt_tokens, cached, u.completion_tokens, c.num_reasoning_tokens)

    def _keep(self, response: dict[str, Any], record: tuple[ResponsesRequest, str, list[dict[str, Any]]]) -> None:
        req, owner, conversation = record
        if req.store is False or response["status"] == "failed":
            return
        outputs = [as_input_item(item) for item in response["output"]]
        self.store.put(StoredResponse(response["id"], owner, response, conversation + outputs))
        self._store_gauges()

    # ---- GET / DELETE /v1/responses/{id} -----------------------------------------------------
    def get_response(self, request: Request, response_id: str) -> Response:
        entry = self.store.get(response_id, request_owner(request), param="response_id")
        self._store_gauges()  # a lookup also drops expired entries
        return JSONResponse(entry.response)

    def delete_response(self, request: Request, response_id: str) -> Response:
        self.store.delete(response_id, request_owner(request))
        self._store_gauges()
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _deltas(reader: ToolCallReader | None, c: CompletionOutput) -> list[ContentDelta | ToolCallDelta]:
    """`c`'s new text as deltas: the tool-call reader's, or plain content without tools."""
    if reader is None:
        return [ContentDelta(c.delta_text)] if c.delta_text else []
    return reader.read(c)


def _finish_reason(reader: ToolCallReader | None, c: CompletionOutput) -> str | None:
    """The engine's reason, except that a list the duplicate-call guard ended is complete:
    "stop" (status "completed") even when max_output_tokens came in the steps after it."""
    return "stop" if reader is not None and reader.ended else c.finish_reason


def _error_event(exc: BaseException) -> bytes:
    """An `error` event, for a failure outside the event generator's own handling."""
    error = to_api_error(exc)
    body = {"type": "error", "code": error.code, "message": error.message, "param": error.param,
            "sequence_number": 0}
    return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"


__all__ = ["ENDPOINT", "OWNER_STATE", "ResponsesServing", "request_owner"]

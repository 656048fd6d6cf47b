"""POST /v1/chat/completions: messages rendered by the model's chat template, one prompt,
`n` choices. Streamed: a role chunk per choice, content chunks, then a finish chunk.

Structured outputs: `response_format` / `structured_outputs` / `guided_*` become one
grammar (server/protocol.py: `structured_output_spec`), compiled before the stream starts.

Tools: the tools reach the prompt through the chat template when it has a tools branch,
otherwise through a Hermes-style system block (server/tools/), and the tool history
(assistant `tool_calls`, `tool` messages) is rendered the same way. The reply is read by
the `--tool-call-parser` into `message.tool_calls` (finish_reason "tool_calls"); streamed,
each call's id and name go out first, then its argument fragments. tool_choice "required"
or a named function constrains the output with a grammar, so the call always parses and
its arguments validate; "auto" with a `strict` tool constrains a call once it starts;
"none" leaves the tools out of the prompt and parses nothing.
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import Response

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputSpec
from server.errors import InvalidRequestError
from server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatResponseToolCall,
    ChatStreamChoice,
    FunctionCallOut,
    chat_logprobs,
    structured_output_spec,
)
from server.serving import (
    Admission,
    OpenAIServing,
    PromptInput,
    PromptResult,
    json_response,
    new_logprobs,
    read_request,
    sse_event,
    sse_response,
)
from server.tools import (
    ContentDelta,
    ParsedToolCalls,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    prepare_conversation,
    template_supports_tools,
    tool_call_grammar,
)

# Tags that some tokenizers (Qwen, Hermes, Llama 3) have as single special tokens: a grammar
# must name them as tokens, not spell them as text.
_TOOL_TAGS = ("<tool_call>", "</tool_call>", "<|python_tag|>")


@dataclass(slots=True)
class _Tools:
    """What a request's tools mean for rendering, constraining and parsing its reply."""

    tools: list[dict[str, Any]] | None
    """The tools as plain OpenAI dicts (with `strict`); None without tools."""
    choice: str | dict[str, Any]
    """"none", "auto", "required" or `{"type": "function", "function": {"name"}}`."""
    parallel: bool

    @property
    def active(self) -> bool:
        """The model may call tools: they are in the prompt and its reply is parsed."""
        return bool(self.tools) and self.choice != "none"


def render_chat(
    tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
    tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
) -> list[int]:
    """The prompt's token ids: the messages (and tools) through the chat template."""
    conversation = [m.for_template() for m in messages]
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:  # e.g. a base model's GGUF file: completions work, chat needs a template
        raise InvalidRequestError(
            "this model has no chat template: start the server with --chat-template FILE, or use /v1/completions",
            param="messages",
        )
    conversation, tools_arg = prepare_conversation(conversation, tools, template_supports_tools(template))
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tools_arg, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        )
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        # The template's own raise_exception (e.g. "roles must alternate") and a missing template.
        raise InvalidRequestError(f"cannot apply the chat template: {e}", param="messages") from e
    # The template writes the special tokens itself.
    return tokenizer.encode(text, add_special_tokens=False)


class ChatServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        config = serving.config
        self.chat_template: str | None = None
        if config.chat_template is not None:
            with open(config.chat_template, encoding="utf-8") as f:
                self.chat_template = f.read()
        self.tool_parser: type[ToolParser] = get_tool_parser(config.tool_call_parser)
        # Read before the engine loop starts: the tokenizer is the engine thread's after that.
        added = serving.engine.tokenizer.get_added_vocab()
        self.special_tool_tags = tuple(t for t in _TOOL_TAGS if t in added)

    async def create_chat_completion(self, request: Request) -> Response:
        arrival = time.monotonic()
        serving = self.serving
        req = await read_request(request, ChatCompletionRequest, serving.config.max_body_bytes)
        serving.check_model(req.model)
        tools, admission, prompt = await self.admit_prompt(req, request)
        top_k = req.top_logprobs or 0
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = serving.start_streams(request_id, [prompt], req.cache_salt, admission, arrival, "chat_completions")
        if req.stream:
            events = self._stream(req, tools, request_id, created, prompt, stream)
            return sse_response(serving.sse_events(events), admission)
        try:
            finals, results = await serving.until_disconnected(request, serving.collect(stream, 1, req.n))
        finally:
            admission.release_all()
        choices = []
        num_completion_tokens = 0
        for c in finals[0]:
            num_completion_tokens += len(c.token_ids)
            message, finish_reason = self._message(c, tools)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=chat_logprobs(c.logprobs or [], top_k, serving.hidden_ids(req)) if req.logprobs else None,
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=request_id, created=created, model=serving.model_name, choices=choices,
            usage=serving.usage([prompt], results, num_completion_tokens),
        )
        return json_response(response)

    async def admit_prompt(
        self, req: ChatCompletionRequest, request: Request | None = None
    ) -> tuple[_Tools, Admission, PromptInput]:
        """What a chat-shaped request (chat, or a Responses request turned into one) goes
        through before its stream starts: its tools, its grammar (compiled here, so a bad one
        is a 400), its sampling params, its queue places, then its rendered prompt's tokens."""
        serving = self.serving
        tools = _request_tools(req)
        spec, kind = self._output_constraint(req, tools)
        top_k = req.top_logprobs or 0
        params = serving.sampling_params(req, req.output_limit, top_k if req.logprobs else None, structured_output=spec)
        await serving.prepare_structured_output(spec, kind)
        admission = serving.admit(req.n, request, req.priority)
        [prompt] = await serving.tokenize(admission, self._tokenize, req, params, tools)
        return tools, admission, prompt

    def _output_constraint(self, req: ChatCompletionRequest, tools: _Tools) -> tuple[StructuredOutputSpec | None, str | None]:
        """The grammar the reply must follow, and its kind for the metrics: the tool-call
        grammar when the tool choice demands one, else the response format's, else none."""
        spec = structured_output_spec(req)
        if not tools.active:
            return spec, None
        grammar = tool_call_grammar(
            tools.tools, tools.choice, tools.parallel, self.serving.config.tool_call_parser, self.special_tool_tags
        )
        if grammar is None:
            return spec, None
        if spec is not None and tools.choice == "auto":
            # Free text under one grammar, calls under another: one request has one grammar.
            raise InvalidRequestError(
                "a response format cannot be combined with strict tools under tool_choice 'auto'; drop one, "
                "or set tool_choice to 'required' or a function",
                param="response_format",
            )
        # "required" / a named function: the reply is a call, never text in a response format.
        return StructuredOutputSpec.grammar(grammar, param="tools"), "tools"

    def _tokenize(
        self, tokenizer: Any, req: ChatCompletionRequest, params: SamplingParams, tools: _Tools
    ) -> list[PromptInput]:
        serving = self.serving
        token_ids = render_chat(
            tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message,
            tools.tools if tools.active else None, self.chat_template,
        )
        if not token_ids:
            raise InvalidRequestError("the messages render to no tokens", param="messages")
        if params.max_tokens is None:
            params = serving.fit_open_max_tokens(token_ids, params, "messages")
        serving.validate_prompt(token_ids, params, "messages")
        return [PromptInput(token_ids, None, params)]

    def _message(self, c: CompletionOutput, tools: _Tools) -> tuple[ChatResponseMessage, str | None]:
        """The choice's message and finish reason: tool calls parsed out of the text when
        the model may call tools (finish_reason "tool_calls" once a call completed)."""
        if not tools.active:
            return ChatResponseMessage(content=c.text), c.finish_reason
        parsed = self.tool_parser().parse(c.text)
        if not parsed.calls:
            return ChatResponseMessage(content=parsed.content or ""), c.finish_reason
        return _calls_message(parsed), "tool_calls" if c.finish_reason == "stop" else c.finish_reason

    async def _stream(
        self, req: ChatCompletionRequest, tools: _Tools, request_id: str, created: int, prompt: PromptInput,
        stream: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[bytes]:
        serving = self.serving
        top_k = req.top_logprobs or 0
        hidden_ids = serving.hidden_ids(req)
        num_logprobs_sent = [0] * req.n
        num_tokens = [0] * req.n
        # Per choice: the tool-call parser's stream, and whether a call came out of it.
        parsers = [self.tool_parser().streaming() for _ in range(req.n)] if tools.active else None
        made_calls = [False] * req.n
        result = PromptResult()

        def chunk(index: int, delta: dict[str, Any], logprobs=None, finish_reason=None, stop_reason=None) -> bytes:
            return sse_event(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=serving.model_name,
                    choices=[ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                              finish_reason=finish_reason, stop_reason=stop_reason)],
                )
            )

        def text_chunks(index: int, text: str, finished: bool, logprobs) -> list[bytes]:
            """The chunks for new text: plain content, or the tool parser's deltas."""
            if parsers is None:
                return [chunk(index, {"content": text}, logprobs)] if text or logprobs is not None else []
            deltas = parsers[index].feed(text) + (parsers[index].finish() if finished else [])
            out = [chunk(index, _stream_delta(d), logprobs if i == 0 else None) for i, d in enumerate(deltas)]
            made_calls[index] |= any(isinstance(d, ToolCallDelta) for d in deltas)
            if not out and logprobs is not None:
                out.append(chunk(index, {"content": ""}, logprobs))
            return out

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
                    for event in text_chunks(c.index, c.delta_text, c.finish_reason is not None, logprobs):
                        yield event
                    if c.finish_reason is not None:
                        reason = "tool_calls" if made_calls[c.index] and c.finish_reason == "stop" else c.finish_reason
                        yield chunk(c.index, {}, None, reason, c.stop_reason)
        if req.include_usage:
            yield sse_event(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=serving.model_name, choices=[],
                    usage=serving.usage([prompt], [result], sum(num_tokens)),
                )
            )


def _request_tools(req: ChatCompletionRequest) -> _Tools:
    tools = req.effective_tools
    choice = req.effective_tool_choice
    return _Tools(
        tools=[{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools] if tools else None,
        choice=choice if isinstance(choice, str) else choice.model_dump(),
        parallel=req.effective_parallel_tool_calls,
    )


def _calls_message(parsed: ParsedToolCalls) -> ChatResponseMessage:
    return ChatResponseMessage(
        content=parsed.content,
        tool_calls=[
            ChatResponseToolCall(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
            for call in parsed.calls
        ],
    )


def _stream_delta(delta: ContentDelta | ToolCallDelta) -> dict[str, Any]:
    """One parser delta as a chat chunk's `delta`: content, or one `tool_calls` entry whose
    first chunk carries the call's id, type and name (arguments ""), later ones fragments."""
    if isinstance(delta, ContentDelta):
        return {"content": delta.text}
    entry: dict[str, Any] = {"index": delta.index}
    function: dict[str, str] = {"arguments": delta.arguments}
    if delta.id is not None:
        entry["id"] = delta.id
        entry["type"] = "function"
    if delta.name is not None:
        function["name"] = delta.name
    entry["function"] = function
    return {"tool_calls": [entry]}

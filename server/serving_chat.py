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
"none" leaves the tools out of the prompt and parses nothing. The reply is read while it is
generated (`ToolCallReader`): a call that repeats an earlier one exactly, or one past
`--max-parallel-tool-calls` (past the first without `parallel_tool_calls`), ends the list and
stops the sample, which finishes with "tool_calls" (server/tools/guard.py).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

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
    CompletionTokensDetails,
    FunctionCallOut,
    Tool,
    chat_logprobs,
    structured_output_spec,
)
from server.protocol_vllm import chat_echo_prefix, prompt_logprobs_out
from server.reasoning import ReasoningParser, reasoning_parser
from server.request_id import response_id
from server.serving import (
    Admission,
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
from server.tools import (
    ContentDelta,
    Delta,
    GuardedToolCallStream,
    ParsedToolCalls,
    ToolCallDelta,
    ToolParser,
    collect_deltas,
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
    max_calls: int
    """Most calls in one reply: 1 without `parallel_tool_calls`, else --max-parallel-tool-calls."""

    @property
    def active(self) -> bool:
        """The model may call tools: they are in the prompt and its reply is parsed."""
        return bool(self.tools) and self.choice != "none"


class ToolCallReader:
    """One sample's reply read for tool calls while it is generated: the tool parser's deltas
    past the duplicate-call guard (server/tools/guard.py). When the guard ends the list the
    sample is stopped in the engine (`stop`), its later text is ignored, and it finishes with
    "tool_calls"."""

    def __init__(self, stream: GuardedToolCallStream, stop: Callable[[], None]) -> None:
        self._stream = stream
        self._stop = stop
        self.deltas: list[Delta] = []
        """Everything read so far (what the whole reply adds up to)."""

    @property
    def ended(self) -> bool:
        return self._stream.ended

    def read(self, c: CompletionOutput) -> list[Delta]:
        """The deltas of `c`'s new text (and of the reply's end, once `c` finished)."""
        if self.ended:
            return []
        deltas = self._stream.feed(c.delta_text) + (self._stream.finish() if c.finish_reason is not None else [])
        if self.ended:
            self._stop()
        self.deltas += deltas
        return deltas

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" once a call completed the reply, else the engine's reason."""
        if self.ended or (engine_reason == "stop" and any(isinstance(d, ToolCallDelta) for d in self.deltas)):
            return "tool_calls"
        return engine_reason


def render_chat(
    tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
    tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids: the messages (and tools) through the chat template, with
    `template_kwargs` as extra template variables (e.g. `enable_thinking`)."""
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
            **(template_kwargs or {}),
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
        self.max_parallel_tool_calls = config.max_parallel_tool_calls
        # Read before the engine loop starts: the tokenizer is the engine thread's after that.
        added = serving.engine.tokenizer.get_added_vocab()
        self.special_tool_tags = tuple(t for t in _TOOL_TAGS if t in added)
        self.reasoning: ReasoningParser | None = reasoning_parser(
            config.reasoning_parser, serving.engine.tokenizer,
            self.chat_template or getattr(serving.engine.tokenizer, "chat_template", None),
        )
        """The model's thinking form (--reasoning-parser); None: no thinking is separated."""

    async def create_chat_completion(self, request: Request) -> Response:
        arrival = time.monotonic()
        serving = self.serving
        req = await read_request(request, ChatCompletionRequest, serving.config.max_body_bytes)
        serving.check_model(req.model)
        tools, admission, prompt = await self.admit_prompt(req, request)
        top_k = self._top_k(req)
        request_id, given = response_id(request, "chatcmpl")
        engine_id = serving.engine_request_id(request_id, given)
        created = int(time.time())
        stream = serving.start_streams(engine_id, [prompt], req.cache_salt, admission, arrival, "chat_completions")
        readers = [self.tool_call_reader(tools, engine_id, i) for i in range(req.n)] if tools.active else None
        if req.stream:
            events = self._stream(req, tools, request_id, created, prompt, stream, readers)
            return sse_response(serving.sse_events(events), admission)
        on_output = (lambda _, c: readers[c.index].read(c)) if readers is not None else None
        try:
            finals, results = await serving.until_disconnected(
                request, serving.collect(stream, 1, req.n, on_output))
        finally:
            admission.release_all()
        choices = []
        num_completion_tokens = 0
        echo_prefix = chat_echo_prefix(req)
        as_token_ids = serving.as_token_ids(req)
        for c in finals[0]:
            num_completion_tokens += len(c.token_ids)
            message, finish_reason = self._message(c, readers[c.index] if readers is not None else None)
            message.reasoning_content = message.reasoning = c.reasoning_text
            if echo_prefix:
                message.content = echo_prefix + (message.content or "")
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=(chat_logprobs(c.logprobs or [], top_k, serving.hidden_ids(req), as_token_ids)
                              if req.logprobs else None),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if req.return_token_ids else None,
                )
            )
        num_prompt_logprobs = serving.num_logprobs(req.prompt_logprobs, "prompt_logprobs")
        response = ChatCompletionResponse(
            id=request_id, created=created, model=req.model or serving.model_name, choices=choices,
            usage=self._usage(prompt, results, num_completion_tokens, sum(c.num_reasoning_tokens for c in finals[0])),
            prompt_logprobs=(None if num_prompt_logprobs is None
                             else prompt_logprobs_out(prompt_entries(prompt, results[0]), num_prompt_logprobs)),
            prompt_token_ids=prompt.token_ids if req.return_token_ids else None,
        )
        return json_response(response)

    def _usage(self, prompt: PromptInput, results: list[PromptResult], num_completion_tokens: int,
               num_reasoning_tokens: int):
        """The usage, with `completion_tokens_details.reasoning_tokens` when the model thinks."""
        usage = self.serving.usage([prompt], results, num_completion_tokens)
        if self.reasoning is not None:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=num_reasoning_tokens)
        return usage

    def template_kwargs(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """The request's extra chat-template variables: its `chat_template_kwargs`, and the
        switch that turns thinking off for `reasoning_effort: "none"`."""
        kwargs = dict(req.chat_template_kwargs or {})
        if self.reasoning is not None and req.reasoning_effort == "none" and "enable_thinking" not in kwargs:
            try:
                kwargs |= self.reasoning.template_kwargs(enabled=False)
            except ValueError as e:
                raise InvalidRequestError(f"reasoning_effort 'none': {e}", param="reasoning_effort") from e
        return kwargs

    def _top_k(self, req: ChatCompletionRequest) -> int:
        """The alternatives per token `top_logprobs` asks for (-1: the vocabulary), within --max-logprobs."""
        return self.serving.num_logprobs(req.top_logprobs, "top_logprobs") or 0

    def tool_call_reader(self, tools: _Tools, request_id: str, index: int) -> ToolCallReader:
        """Sample `index`'s reader of the stream `start_streams(request_id, ...)` started."""
        return ToolCallReader(GuardedToolCallStream(self.tool_parser().streaming(), tools.max_calls),
                              lambda: self.serving.stop_sample(request_id, 0, index))

    async def admit_prompt(
        self, req: ChatCompletionRequest, request: Request | None = None
    ) -> tuple[_Tools, Admission, PromptInput]:
        """What a chat-shaped request (chat, or a Responses request turned into one) goes
        through before its stream starts: its tools, its grammar (compiled here, so a bad one
        is a 400), its sampling params, its queue places, then its rendered prompt's tokens."""
        serving = self.serving
        tools, params = await self._prepare(req)
        admission = serving.admit(req.n, request, req.priority)
        [prompt] = await serving.tokenize(admission, self._tokenize, req, params, tools)
        return tools, admission, prompt

    async def render_prompt(self, req: ChatCompletionRequest) -> PromptInput:
        """The prompt `admit_prompt` would give the engine (its token ids and sampling
        params), without taking queue places: `POST /v1/chat/completions/render`."""
        tools, params = await self._prepare(req, count=False)
        [prompt] = await self.serving.tokenizers.run(self._tokenize, req, params, tools)
        return prompt

    async def _prepare(self, req: ChatCompletionRequest, count: bool = True) -> tuple[_Tools, SamplingParams]:
        """The request's tools and sampling params, its grammar compiled (a bad one is a 400)."""
        serving = self.serving
        tools = _request_tools(req, self.max_parallel_tool_calls)
        spec, kind = self._output_constraint(req, tools)
        top_k = self._top_k(req)
        params = serving.sampling_params(req, req.output_limit, top_k if req.logprobs else None,
                                         serving.num_logprobs(req.prompt_logprobs, "prompt_logprobs"),
                                         structured_output=spec)
        await serving.prepare_structured_output(spec, kind, count)
        return tools, params

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
                f"an output constraint ({spec.param or 'response_format'}) cannot be combined with strict tools under "
                "tool_choice 'auto'; drop one, or set tool_choice to 'required' or a function",
                param=spec.param or "response_format",
            )
        # "required" / a named function: the reply is a call, never text in a response format.
        return StructuredOutputSpec.grammar(grammar, param="tools"), "tools"

    def _tokenize(
        self, tokenizer: Any, req: ChatCompletionRequest, params: SamplingParams, tools: _Tools
    ) -> list[PromptInput]:
        serving = self.serving
        token_ids = render_chat(
            tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message,
            tools.tools if tools.active else None, self.chat_template, self.template_kwargs(req),
        )
        if not token_ids:
            raise InvalidRequestError("the messages render to no tokens", param="messages")
        if self.reasoning is not None:
            params = self._with_thinking(tokenizer, token_ids, req, params)
        token_ids = serving.truncate(token_ids, req)
        if params.max_tokens is None:
            params = serving.fit_open_max_tokens(token_ids, params, "messages")
        serving.validate_prompt(token_ids, params, "messages")
        return [PromptInput(token_ids, None, params)]

    def _with_thinking(
        self, tokenizer: Any, token_ids: list[int], req: ChatCompletionRequest, params: SamplingParams
    ) -> SamplingParams:
        """`params` with the prompt's thinking section (engine/thinking.py), so that the
        reply's thinking is reported apart and the grammar and tool calls see the answer."""
        budget = req.thinking_budget
        if params.use_beam_search:
            if budget is not None:
                param = "thinking_token_budget" if req.thinking_token_budget is not None else "max_reasoning_tokens"
                raise InvalidRequestError(f"{param} cannot be used with use_beam_search", param=param)
            return params  # beams are ranked on whole outputs: the thinking stays in the content
        return dataclasses.replace(params, thinking=self.reasoning.thinking_spec(tokenizer, token_ids, budget))

    def _message(self, c: CompletionOutput, reader: ToolCallReader | None) -> tuple[ChatResponseMessage, str | None]:
        """The choice's message and finish reason: the tool calls `reader` read out of the
        text when the model may call tools (finish_reason "tool_calls" once a call completed)."""
        if reader is None:
            return ChatResponseMessage(content=c.text), c.finish_reason
        parsed = collect_deltas(reader.deltas)
        if not parsed.calls:
            return ChatResponseMessage(content=parsed.content or ""), c.finish_reason
        return _calls_message(parsed), reader.finish_reason(c.finish_reason)

    async def _stream(
        self, req: ChatCompletionRequest, tools: _Tools, request_id: str, created: int, prompt: PromptInput,
        stream: AsyncIterator[tuple[int, RequestOutput]], readers: list[ToolCallReader] | None,
    ) -> AsyncIterator[bytes]:
        serving = self.serving
        top_k = self._top_k(req)
        hidden_ids = serving.hidden_ids(req)
        as_token_ids = serving.as_token_ids(req)
        num_logprobs_sent = [0] * req.n
        num_token_ids_sent = [0] * req.n
        num_tokens = [0] * req.n
        num_reasoning_tokens = [0] * req.n
        finished = [False] * req.n  # the choice's finish chunk went out
        result = PromptResult()

        def chunk(index: int, delta: dict[str, Any], logprobs=None, finish_reason=None, stop_reason=None,
                  token_ids=None, prompt_token_ids=None) -> bytes:
            return sse_event(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=req.model or serving.model_name,
                    choices=[ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                              stop_reason=stop_reason, token_ids=token_ids)],
                    prompt_token_ids=prompt_token_ids,
                    # vLLM's continuous_usage_stats: this choice's tokens so far, on every chunk.
                    usage=(serving.chunk_usage(len(prompt.token_ids), num_tokens[index])
                           if req.continuous_usage else None),
                )
            )

        def text_chunks(index: int, c: CompletionOutput, logprobs, token_ids) -> list[bytes]:
            """The chunks for new text: plain content, or the tool parser's deltas; the step's
            logprobs and token ids go with the first."""
            if readers is None:
                text = c.delta_text
                if not (text or logprobs is not None or token_ids):
                    return []
                return [chunk(index, {"content": text}, logprobs, token_ids=token_ids)]
            deltas = readers[index].read(c)
            out = [chunk(index, _stream_delta(d), logprobs if i == 0 else None, token_ids=token_ids if i == 0 else None)
                   for i, d in enumerate(deltas)]
            if not out and (logprobs is not None or token_ids):
                out.append(chunk(index, {"content": ""}, logprobs, token_ids=token_ids))
            return out

        for index in range(req.n):
            # As vLLM: the prompt's token ids in the stream's first chunk.
            yield chunk(index, {"role": "assistant", "content": ""},
                        prompt_token_ids=prompt.token_ids if req.return_token_ids and index == 0 else None)
        if echo_prefix := chat_echo_prefix(req):
            for index in range(req.n):
                yield chunk(index, {"content": echo_prefix})
        async with aclosing(stream):
            async for _, out in stream:
                result.update(out)
                for c in out.outputs:
                    num_tokens[c.index] = len(c.token_ids)
                    if finished[c.index]:  # the guard ended its list; the stop is on its way
                        continue
                    logprobs = token_ids = None
                    if req.logprobs:
                        new = new_logprobs(c, num_logprobs_sent[c.index])
                        num_logprobs_sent[c.index] += len(new)
                        if new:
                            logprobs = chat_logprobs(new, top_k, hidden_ids, as_token_ids)
                    if req.return_token_ids:
                        token_ids = list(c.token_ids[num_token_ids_sent[c.index]:])
                        num_token_ids_sent[c.index] = len(c.token_ids)
                    num_reasoning_tokens[c.index] = c.num_reasoning_tokens
                    if thinking := c.delta_reasoning_text:
                        # Before the step's answer text: the thinking came first. Both names (vLLM's old and new).
                        yield chunk(c.index, {"reasoning_content": thinking, "reasoning": thinking}, logprobs,
                                    token_ids=token_ids)
                        logprobs = token_ids = None
                    for event in text_chunks(c.index, c, logprobs, token_ids):
                        yield event
                    reader = readers[c.index] if readers is not None else None
                    if reader is not None and reader.ended:  # before the engine's own end
                        finished[c.index] = True
                        yield chunk(c.index, {}, None, "tool_calls")
                    elif c.finish_reason is not None:
                        finished[c.index] = True
                        reason = reader.finish_reason(c.finish_reason) if reader is not None else c.finish_reason
                        yield chunk(c.index, {}, None, reason, c.stop_reason)
        if req.include_usage:
            yield sse_event(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=req.model or serving.model_name, choices=[],
                    usage=self._usage(prompt, [result], sum(num_tokens), sum(num_reasoning_tokens)),
                )
            )


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as plain OpenAI dicts (with `strict`), as the prompt shows them: the chat
    route and /tokenize (server/serving_tokenize.py) render the same tokens from them."""
    if not tools:
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def _request_tools(req: ChatCompletionRequest, max_parallel_calls: int) -> _Tools:
    choice = req.effective_tool_choice
    parallel = req.effective_parallel_tool_calls
    return _Tools(
        tools=template_tools(req.effective_tools),
        choice=choice if isinstance(choice, str) else choice.model_dump(),
        parallel=parallel,
        max_calls=max_parallel_calls if parallel else 1,
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

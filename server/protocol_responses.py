"""The OpenAI Responses API protocol (`POST /v1/responses`): the request model, its input
items, and the response object and output items as OpenAI defines them.

A request is checked here with errors that name the Responses fields (`input[2].content[0]`,
`text.format`, `tools[1]`), then becomes a `ChatCompletionRequest`
(`ResponsesRequest.to_chat_request`) so that rendering, tools, grammars and sampling are
the chat path's own. Input items are normalized to three shapes, which is also how the
response store keeps a conversation:

- `{"type": "message", "role", "content": str}` (text parts joined by newlines),
- `{"type": "function_call", "call_id", "name", "arguments"}`,
- `{"type": "function_call_output", "call_id", "output": str}`,
- `{"type": "reasoning", "text": str}` (a reasoning model's thinking: its `content` texts;
  it goes to the next assistant turn as `reasoning_content`, for templates that show it).

Fields are implemented, documented no-ops (they cannot change what a local model
generates), or refused with a 400 naming them (`REFUSED_FIELDS`); docs/RESPONSES.md lists
them.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, Mapping

from pydantic import Field, field_validator, model_validator

from server.errors import InvalidRequestError
from server.protocol import (
    MAX_TOOLS,
    FunctionDefinition,
    Metadata,
    Refusal,
    _refuse_fields,
    _Request,
)

MAX_INPUT_ITEMS = 4096
"""Most items in one request's `input` (a conversation, not a data set)."""

REFUSED_FIELDS: Mapping[str, Refusal] = {
    "background": Refusal("background responses are not implemented; stream instead", (None, False)),
    "background_options": Refusal("background responses are not implemented"),
    "conversation": Refusal("the Conversations API is not implemented; use previous_response_id"),
    "context_management": Refusal("server-side context compaction is not implemented"),
    "include": Refusal("no extra output data (logprobs, encrypted reasoning, search results) is available",
                       (None, [])),
    "max_tool_calls": Refusal("built-in tool calls do not exist here, and function calls are limited by "
                              "parallel_tool_calls"),
    "prompt": Refusal("stored prompt templates are not implemented; send input and instructions"),
    "top_logprobs": Refusal("logprobs are not implemented on /v1/responses; use /v1/chat/completions", (None, 0)),
    "truncation": Refusal("'auto' truncation is not implemented: a too long conversation is a 400",
                          (None, "disabled")),
    "access_programs": Refusal("access programs are not implemented"),
    "moderation": Refusal("moderation is not implemented"),
    "image": Refusal("this model generates text only"),
}

_TEXT_ONLY = "this model takes text only (parts of type 'input_text')"
_BUILT_IN_TOOL = "only type 'function' is supported (built-in tools such as web search, file search or code " \
                 "interpreter do not exist on this server)"


def _text_of(content: Any, param: str, allowed: tuple[str, ...]) -> str:
    """A message's content as text: a string, or text parts (types in `allowed`) joined by
    newlines; any other part is a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param} must be a string or a list of content parts", param=param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequestError(f"{where} must be a content part object with a type", param=where)
        if part["type"] not in allowed:
            raise InvalidRequestError(
                f"{where}: content parts of type {part['type']!r} are not supported: {_TEXT_ONLY}", param=where
            )
        key = "refusal" if part["type"] == "refusal" else "text"
        if not isinstance(part.get(key), str):
            raise InvalidRequestError(f"{where}: a {part['type']!r} part needs {key!r} (a string)", param=where)
        texts.append(part[key])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, param: str, non_empty: bool = True) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (non_empty and not value):
        raise InvalidRequestError(f"{param}: a {item.get('type', 'message')!r} item needs {key!r} (a "
                                  f"{'non-empty ' if non_empty else ''}string)", param=f"{param}.{key}")
    return value


_ROLES = ("user", "system", "developer", "assistant")


def normalize_item(item: Any, param: str) -> dict[str, Any]:
    """One input item in its normalized shape (module docstring); 400 naming `param` (and
    the part of it) for anything this server cannot take."""
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{param} must be an object (a message or a function call item)", param=param)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequestError(f"{param}.role must be one of {', '.join(_ROLES)}, got {role!r}",
                                      param=f"{param}.role")
        allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
        if "content" not in item:
            raise InvalidRequestError(f"{param}: a message needs 'content'", param=f"{param}.content")
        return {"type": "message", "role": role, "content": _text_of(item["content"], f"{param}.content", allowed)}
    if kind == "function_call":
        return {"type": "function_call", "call_id": _string(item, "call_id", param),
                "name": _string(item, "name", param), "arguments": _string(item, "arguments", param, False)}
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            output = _text_of(output, f"{param}.output", ("input_text",))
        if not isinstance(output, str):
            raise InvalidRequestError(f"{param}: a 'function_call_output' item needs 'output' (a string)",
                                      param=f"{param}.output")
        return {"type": "function_call_output", "call_id": _string(item, "call_id", param), "output": output}
    if kind == "reasoning":
        content = item.get("content") or []
        if not isinstance(content, list):
            raise InvalidRequestError(f"{param}.content must be a list of reasoning_text parts", param=f"{param}.content")
        return {"type": "reasoning", "text": _text_of(content, f"{param}.content", ("reasoning_text",))}
    if kind == "item_reference":
        raise InvalidRequestError(f"{param}: item references are not supported; send the item itself, or "
                                  "previous_response_id", param=param)
    raise InvalidRequestError(
        f"{param} has type {kind!r}; the items this server takes are 'message', 'function_call', "
        "'function_call_output' and 'reasoning'", param=param)


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized items as chat messages: instructions first as the system message, a
    function call joined to the assistant turn just before it, its output a tool message, a
    reasoning item the `reasoning_content` of the assistant turn after it."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning: str | None = None  # a reasoning item's text, for the next assistant turn
    for item in items:
        if item["type"] == "reasoning":
            reasoning = item["text"] if reasoning is None else reasoning + "\n" + item["text"]
        elif item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and reasoning is None:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        if reasoning is not None and item["type"] != "reasoning":
            if messages[-1]["role"] == "assistant":
                messages[-1]["reasoning_content"] = reasoning
            reasoning = None
    return messages


# ---- the request -----------------------------------------------------------------------------
class FunctionTool(FunctionDefinition):
    """A function tool in the Responses shape: the chat tool's function, flat, with its type."""

    type: Literal["function"]


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    """`text.format`: `{"type": "text"}`, `{"type": "json_object"}` or `{"type":
    "json_schema", "name", "schema", "description"?, "strict"?}` (always held to the schema)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_where_needed(self) -> "TextFormat":
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("a 'json_schema' format needs 'name' and 'schema' (the JSON schema the output must match)")
        if self.type != "json_schema" and (self.schema_ is not None or self.name is not None):
            raise ValueError(f"a {self.type!r} format takes no name or schema")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted no-op: the model has no verbosity control."""


class ReasoningConfig(_Request):
    """`reasoning`, for a model with a reasoning parser (server/reasoning.py; others: 400).
    `effort` "none" turns the thinking off where the chat template can, other efforts leave
    it on (no other control exists); `summary` may be "auto" (OpenAI's: summaries at the
    model's discretion), and none is written: the thinking is returned whole, as the
    reasoning item's `content`."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None
    """The deprecated name of `summary`."""

    @field_validator("summary", "generate_summary", mode="before")
    @classmethod
    def _no_written_summaries(cls, value: Any) -> Any:
        if value in ("concise", "detailed"):
            raise ValueError(f"{value!r} summaries are not written here: the reasoning item carries the whole "
                             "thinking as its content ('auto' or null accepted)")
        return value

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.effort, self.summary, self.generate_summary))


class ResponsesRequest(_Request):
    """POST /v1/responses.

    Accepted no-ops: `user`, `service_tier`, `safety_identifier`, `prompt_cache_key`,
    `prompt_cache_retention`, `prompt_cache_options` (the prefix cache is automatic),
    `stream_options`, `text.verbosity`. `metadata` is kept and returned.
    """

    REFUSED_FIELDS: ClassVar[Mapping[str, Refusal]] = REFUSED_FIELDS

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    store: bool | None = True
    stream: bool | None = False
    metadata: Metadata | None = None
    user: str | None = None
    priority: int | None = Field(None, ge=-1000, le=1000)
    """vLLM's scheduling priority, as on the chat and completions endpoints (lower first;
    with a named API key, no lower than the key's priority)."""
    # Accepted no-ops (see the class docstring).
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        _refuse_fields(data, cls.REFUSED_FIELDS)
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _normalize_input(cls, value: Any) -> Any:
        # InvalidRequestError, not ValueError: pydantic passes it through with its param.
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if not isinstance(value, list):
            raise InvalidRequestError("input must be a string or a list of items", param="input")
        if len(value) > MAX_INPUT_ITEMS:
            raise InvalidRequestError(f"input has {len(value)} items; at most {MAX_INPUT_ITEMS}", param="input")
        return [normalize_item(item, f"input[{i}]") for i, item in enumerate(value)]

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise InvalidRequestError(f"tools[{i}] has type {tool.get('type')!r}; {_BUILT_IN_TOOL}",
                                          param=f"tools[{i}]")
        return tools

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[FunctionTool] | None) -> list[FunctionTool] | None:
        seen: set[str] = set()
        for i, tool in enumerate(tools or []):
            if tool.name in seen:
                raise ValueError(f"tools[{i}] repeats the name {tool.name!r}")
            seen.add(tool.name)
        return tools

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, choice: Any) -> Any:
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise InvalidRequestError(f"tool_choice has type {choice.get('type')!r}; {_BUILT_IN_TOOL}",
                                      param="tool_choice")
        return choice

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: Any) -> Any:
        if "tools" not in info.data:  # tools failed: their error is the one to report
            return choice
        names = [t.name for t in info.data["tools"] or []]
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools to choose from; the request has none")
        if isinstance(choice, FunctionToolChoice) and choice.name not in names:
            raise ValueError(f"tool_choice names the function {choice.name!r}, which is not among the tools")
        return choice

    @property
    def items(self) -> list[dict[str, Any]]:
        """The input as normalized items (a string input is one user message)."""
        return self.input  # type: ignore[return-value]

    @property
    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")

    def to_chat_request(self, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request body this request amounts to, `conversation` being
        the stored chain (if any) followed by this request's input items."""
        body: dict[str, Any] = {
            "messages": chat_messages(self.instructions, conversation),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "priority": self.priority,
        }
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None and self.tools:
            body["tool_choice"] = choice
        fmt = self.text_format
        if fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        return {k: v for k, v in body.items() if v is not None}


# Chat-path field names in errors -> the Responses field a client sent.
_CHAT_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


def responses_param(param: str | None) -> str | None:
    """The Responses field behind a chat-path error's `param`."""
    if param is None:
        return None
    head = param.split("[", 1)[0].split(".", 1)[0]
    if head in _CHAT_PARAMS:
        return _CHAT_PARAMS[head]
    return param


# ---- the response object -----------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text_part(text)]}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning model's thinking: whole, as one `reasoning_text` part (no summary is written)."""
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [reasoning_text_part(text)],
            "encrypted_content": None, "status": status}


def reasoning_text_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def as_input_item(item: dict[str, Any]) -> dict[str, Any]:
    """An output item in the normalized input shape, for the stored conversation."""
    if item["type"] == "reasoning":
        return {"type": "reasoning", "text": "".join(p["text"] for p in item["content"])}
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": "".join(p["text"] for p in item["content"])}
    return {"type": "function_call", "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}


def usage(num_input: int, num_cached: int, num_output: int, num_reasoning: int = 0) -> dict[str, Any]:
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": num_input + num_output}


def response_object(req: ResponsesRequest, response_id: str, model: str, created_at: int | None = None,
                    status: str = "in_progress") -> dict[str, Any]:
    """The response object with the request's settings echoed, no output yet."""
    fmt = req.text_format
    text_format: dict[str, Any] = {"type": fmt.type}
    if fmt.type == "json_schema":
        text_format.update(name=fmt.name, schema=fmt.schema_, strict=fmt.strict, description=fmt.description)
    choice = req.tool_choice
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at if created_at is not None else int(time.time()),
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "metadata": req.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": (None if req.reasoning is None or not req.reasoning.is_set
                      else {"effort": req.reasoning.effort, "summary": req.reasoning.summary or req.reasoning.generate_summary}),
        "service_tier": "default",
        "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": text_format},
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionToolChoice) else (choice or "auto"),
        "tools": [t.model_dump() for t in req.tools or []],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
    }


def finish(response: dict[str, Any], finish_reason: str | None, output: list[dict[str, Any]],
           usage_info: dict[str, Any]) -> dict[str, Any]:
    """`response` completed by its output: status from the engine's finish reason
    ("length" is incomplete for max_output_tokens, "abort" a failure)."""
    response = {**response, "output": output, "usage": usage_info}
    if finish_reason == "length":
        response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    elif finish_reason == "abort":
        response.update(status="failed", error={"code": "server_error",
                                                "message": "the request was aborted (the server is shutting down)"})
    else:
        response["status"] = "completed"
    return response

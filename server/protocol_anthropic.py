"""Anthropic's Messages API protocol (`POST /v1/messages`, `POST /v1/messages/count_tokens`):
the request models, their content blocks, and the message object a reply is.

A request is checked here with errors that name the Messages fields
(`messages[2].content[0].tool_use_id`, `tools[1].input_schema`, `output_config.format`),
then becomes a chat completion request (`MessagesRequest.to_chat_request`) so that the
template, tools, grammars, sampling and admission are the chat path's own:

- `system` (a string or text blocks) is the system message;
- a user turn's `tool_result` blocks are `tool` messages (in order, `is_error` results
  prefixed "Error: "), its text blocks one user message after them;
- an assistant turn's text blocks are its content, its `tool_use` blocks its `tool_calls`
  (`input` as JSON text);
- a last assistant turn with text only is a prefill: the reply continues it;
- `tools` are function tools (`input_schema` the parameters; `strict` as on chat),
  `tool_choice` auto / any / tool / none is chat's auto / required / a named function /
  none, `disable_parallel_tool_use` is `parallel_tool_calls: false`;
- `output_config.format` (a JSON schema) is chat's `response_format`.

Fields are implemented, accepted no-ops (they cannot change what a local model generates:
`cache_control` anywhere, `metadata`, `service_tier`, `inference_geo`, `speed`,
`output_config.effort`, `user_profile_id`, `workspace_id`), or refused with a 400 naming
them (`REFUSED_FIELDS`, server tools, image and document blocks). docs/REQUEST_FIELDS.md
lists them.

Thinking, on a reasoning model (server/reasoning.py): `thinking` "enabled" turns the model's
thinking on with `budget_tokens` as the thinking budget (chat's `thinking_token_budget`: the
engine closes the thinking there), "adaptive" turns it on without a budget (the model decides
how long it thinks), and "disabled" or no `thinking` turns it off (`reasoning_effort: "none"`),
Anthropic's default. An assistant turn's `thinking` and `redacted_thinking` blocks are
accepted and left out of the prompt: chat templates drop a past turn's thinking as well.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, ClassVar, Literal, Mapping

from pydantic import Field, StringConstraints, field_validator, model_validator

from server.errors import InvalidRequestError
from server.protocol import MAX_STOP, MAX_STOP_LEN, MAX_TOOLS, Refusal, _refuse_fields, _Request

MAX_MESSAGES = 4096
"""Most messages in one request (a conversation, not a data set)."""
MAX_USER_ID_LEN = 256

REFUSED_FIELDS: Mapping[str, Refusal] = {
    "container": Refusal("code-execution containers do not exist on this server"),
    "mcp_servers": Refusal("MCP connectors are not implemented: give the MCP tools as tools", (None, [])),
    "context_management": Refusal("server-side context editing is not implemented"),
    "diagnostics": Refusal("prompt-cache diagnostics are not implemented"),
    "output_format": Refusal("the beta output_format is not implemented here: use output_config.format"),
}

_TOOL_REFUSED: Mapping[str, Refusal] = {
    "input_examples": Refusal("tool input examples are not implemented", (None, [])),
    "defer_loading": Refusal("deferred tool loading (tool search) is not implemented", (None, False)),
    "allowed_callers": Refusal("programmatic tool calling is not implemented", (None, [], ["direct"])),
}

ToolName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
StopSequence = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_LEN)]
_TEXT_ONLY = ("this server takes text, tool_use, tool_result and (in assistant turns) thinking blocks "
              "(the model reads text only)")


# ---- content blocks: plain dicts, checked with errors that name the block -------------------
def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise InvalidRequestError(f"{where} must be a content block object with a type", param=where)
    return block["type"]


def _text_of_block(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}: a 'text' block needs 'text' (a string)", param=f"{where}.text")
    if not text:
        raise InvalidRequestError(f"{where}: text content blocks must be non-empty", param=f"{where}.text")
    if block.get("citations"):
        raise InvalidRequestError(f"{where}: citations are not supported", param=f"{where}.citations")
    return text


def _text_blocks(value: Any, where: str, what: str) -> str:
    """A string, or a list of text blocks joined by newlines (any other block: 400)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(value):
        kind = _block_type(block, f"{where}[{j}]")
        if kind != "text":
            raise InvalidRequestError(f"{where}[{j}]: {what} takes text blocks only, got {kind!r}",
                                      param=f"{where}[{j}]")
        texts.append(_text_of_block(block, f"{where}[{j}]"))
    return "\n".join(texts)


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise InvalidRequestError(f"{where}: a 'tool_use' block needs {key!r} (a non-empty string)",
                                      param=f"{where}.{key}")
    if not isinstance(block.get("input"), dict):
        raise InvalidRequestError(f"{where}: a 'tool_use' block needs 'input' (an object)", param=f"{where}.input")
    return {"type": "tool_use", "id": block["id"], "name": block["name"], "input": block["input"]}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise InvalidRequestError(f"{where}: a 'tool_result' block needs 'tool_use_id' (a non-empty string)",
                                  param=f"{where}.tool_use_id")
    is_error = block.get("is_error", False)
    if is_error is not None and not isinstance(is_error, bool):
        raise InvalidRequestError(f"{where}.is_error must be a boolean", param=f"{where}.is_error")
    content = block.get("content", "")
    text = "" if content is None else _text_blocks(content, f"{where}.content", "a tool_result's content")
    return {"type": "tool_result", "tool_use_id": block["tool_use_id"], "content": text, "is_error": bool(is_error)}


def normalize_message(message: Any, where: str, last: bool) -> dict[str, Any]:
    """One message as `{"role", "content": [blocks]}` with blocks `{"type": "text", "text"}`,
    `{"type": "tool_use", "id", "name", "input"}` or `{"type": "tool_result", "tool_use_id",
    "content": str, "is_error"}`; 400 naming the message (and block) otherwise."""
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{where} must be an object with role and content", param=where)
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise InvalidRequestError(f"{where}.role must be 'user' or 'assistant', got {role!r} (the system prompt "
                                  "is the top-level 'system' field)", param=f"{where}.role")
    if "content" not in message:
        raise InvalidRequestError(f"{where}: a message needs 'content'", param=f"{where}.content")
    content = message["content"]
    if isinstance(content, str):
        blocks = [{"type": "text", "text": content}] if content else []
    elif isinstance(content, list):
        blocks = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = _block_type(block, at)
            if kind == "text":
                blocks.append({"type": "text", "text": _text_of_block(block, at)})
            elif kind in ("thinking", "redacted_thinking"):
                if role != "assistant":
                    raise InvalidRequestError(f"{at}: {kind!r} blocks belong to assistant messages", param=at)
                field = "thinking" if kind == "thinking" else "data"
                if not isinstance(block.get(field), str):
                    raise InvalidRequestError(f"{at}: a {kind!r} block needs {field!r} (a string)", param=f"{at}.{field}")
                # Checked, and left out of the prompt (see the module docstring).
            elif kind == "tool_use":
                if role != "assistant":
                    raise InvalidRequestError(f"{at}: 'tool_use' blocks belong to assistant messages", param=at)
                blocks.append(_tool_use(block, at))
            elif kind == "tool_result":
                if role != "user":
                    raise InvalidRequestError(f"{at}: 'tool_result' blocks belong to user messages", param=at)
                blocks.append(_tool_result(block, at))
            else:
                raise InvalidRequestError(f"{at}: content blocks of type {kind!r} are not supported: {_TEXT_ONLY}",
                                          param=at)
    else:
        raise InvalidRequestError(f"{where}.content must be a string or a list of content blocks",
                                  param=f"{where}.content")
    # As Anthropic: only a final assistant turn (a prefill) may be empty.
    if not blocks and not (last and role == "assistant"):
        raise InvalidRequestError(f"{where}: all messages must have non-empty content except for the optional "
                                  "final assistant message", param=f"{where}.content")
    return {"role": role, "content": blocks}


def _check_tool_ids(messages: list[dict[str, Any]]) -> None:
    """Every tool_result answers a tool_use of the assistant turn just before it; tool_use
    ids are unique; a conversation does not end on an unanswered tool_use."""
    seen: set[str] = set()
    previous: set[str] = set()
    for i, m in enumerate(messages):
        current: set[str] = set()
        for j, block in enumerate(m["content"]):
            at = f"messages[{i}].content[{j}]"
            if block["type"] == "tool_use":
                if block["id"] in seen:
                    raise InvalidRequestError(f"{at}: tool_use ids must be unique; {block['id']!r} repeats",
                                              param=f"{at}.id")
                seen.add(block["id"])
                current.add(block["id"])
            elif block["type"] == "tool_result" and block["tool_use_id"] not in previous:
                raise InvalidRequestError(
                    f"{at}: unexpected tool_use_id {block['tool_use_id']!r} in a tool_result block: each tool_result "
                    "must answer a tool_use block of the assistant message just before it", param=f"{at}.tool_use_id")
        previous = current
    if messages[-1]["role"] == "assistant" and previous:
        raise InvalidRequestError("the last message is an assistant turn with tool_use blocks: answer them with "
                                  "tool_result blocks in a user message", param=f"messages[{len(messages) - 1}]")


def chat_messages(system: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized messages as chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for m in messages:
        texts = [b["text"] for b in m["content"] if b["type"] == "text"]
        if m["role"] == "user":
            for b in m["content"]:
                if b["type"] == "tool_result":
                    text = b["content"]
                    if b["is_error"]:
                        text = f"Error: {text}" if text else "Error"
                    out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        calls = [{"id": b["id"], "type": "function",
                  "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}}
                 for b in m["content"] if b["type"] == "tool_use"]
        message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


# ---- the request ------------------------------------------------------------------------------
class AnthropicCacheControl(_Request):
    """Accepted no-op: the prefix cache is automatic (every request reuses what it can)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class AnthropicTool(_Request):
    """A client tool: name, description, the JSON schema of its input. Anthropic's own tool
    types (bash, text editor, web search, ...) are refused by `MessagesBase._client_tools`."""

    REFUSED_FIELDS: ClassVar[Mapping[str, Refusal]] = _TOOL_REFUSED

    type: Literal["custom"] | None = None
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    """As chat's `strict`: the call's input is held to input_schema by a grammar."""
    cache_control: AnthropicCacheControl | None = None
    eager_input_streaming: bool | None = None
    """Accepted no-op: input fragments are always streamed as they are generated."""

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise ValueError("input_schema must be a JSON schema of type 'object'")
        return schema


class AnthropicToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> "AnthropicToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' needs 'name' (the tool the model must use)")
        if self.type != "tool" and self.name is not None:
            raise ValueError(f"a tool_choice of type {self.type!r} takes no name")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ValueError("a tool_choice of type 'none' takes no disable_parallel_tool_use")
        return self


class ThinkingConfig(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1024)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> "ThinkingConfig":
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type 'enabled' needs budget_tokens (>= 1024)")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError(f"thinking of type {self.type!r} takes no budget_tokens")
        return self


class JsonOutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    """Accepted no-op: the model has no effort control."""


class AnthropicMetadata(_Request):
    """Accepted no-op: nothing is stored or attributed per end user."""

    user_id: Annotated[str, StringConstraints(max_length=MAX_USER_ID_LEN)] | None = None


class MessagesBase(_Request):
    """What /v1/messages and /v1/messages/count_tokens share: the conversation, its tools,
    and everything else that shapes the prompt (see the module docstring)."""

    REFUSED_FIELDS: ClassVar[Mapping[str, Refusal]] = REFUSED_FIELDS

    model: str
    messages: list[Any]
    system: str | list[Any] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted no-ops (see the module docstring).
    cache_control: AnthropicCacheControl | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        _refuse_fields(data, cls.REFUSED_FIELDS)
        return data

    # InvalidRequestError, not ValueError, in the "before" validators: pydantic passes it
    # through with its param (the block that is wrong, not the whole field).
    @field_validator("messages", mode="before")
    @classmethod
    def _normalize_messages(cls, value: Any) -> Any:
        if not isinstance(value, list):
            raise InvalidRequestError("messages must be a list of messages", param="messages")
        if not value:
            raise InvalidRequestError("messages must hold at least one message", param="messages")
        if len(value) > MAX_MESSAGES:
            raise InvalidRequestError(f"messages has {len(value)} messages; at most {MAX_MESSAGES}", param="messages")
        messages = [normalize_message(m, f"messages[{i}]", i == len(value) - 1) for i, m in enumerate(value)]
        _check_tool_ids(messages)
        return messages

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, value: Any) -> Any:
        return None if value is None else _text_blocks(value, "system", "system")

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else []):
            if not isinstance(tool, dict):
                continue
            if tool.get("type") not in (None, "custom"):
                raise InvalidRequestError(
                    f"tools[{i}] has type {tool['type']!r}: only client tools (type 'custom' or none, with "
                    "input_schema) are supported; Anthropic's server and built-in tools do not exist here",
                    param=f"tools[{i}].type")
            for name, refusal in _TOOL_REFUSED.items():
                if name in tool and refusal.refuses(tool[name]):
                    raise InvalidRequestError(f"tools[{i}].{name} is not supported: {refusal.reason}",
                                              param=f"tools[{i}].{name}")
        return tools

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[AnthropicTool] | None) -> list[AnthropicTool] | None:
        seen: set[str] = set()
        for i, tool in enumerate(tools or []):
            if tool.name in seen:
                raise ValueError(f"tools[{i}] repeats the name {tool.name!r}")
            seen.add(tool.name)
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: AnthropicToolChoice | None, info: Any) -> AnthropicToolChoice | None:
        if choice is None or "tools" not in info.data:  # tools failed: their error is the one to report
            return choice
        names = [t.name for t in info.data["tools"] or []]
        if choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice of type {choice.type!r} needs tools to choose from; the request has none")
        if choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names the tool {choice.name!r}, which is not among the tools")
        return choice

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """The messages, normalized (see `normalize_message`)."""
        return self.messages

    @property
    def thinking_enabled(self) -> bool:
        return self.thinking is not None and self.thinking.type == "enabled"

    def to_chat_request(self) -> dict[str, Any]:
        """The chat completion request body that renders the same prompt and applies the
        same tools and output constraint; generation fields are `MessagesRequest`'s."""
        messages = self.conversation
        prefill = messages[-1]["role"] == "assistant"
        body: dict[str, Any] = {
            "messages": chat_messages(self.system, messages),
            "add_generation_prompt": not prefill,
            "continue_final_message": prefill,
        }
        # Thinking on a reasoning model (server/reasoning.py): off unless asked, Anthropic's default.
        thinking = self.thinking.type if self.thinking is not None else "disabled"
        if thinking == "disabled":
            body["reasoning_effort"] = "none"
        elif thinking == "enabled":
            body["thinking_token_budget"] = self.thinking.budget_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema, "strict": t.strict}}
                for t in self.tools]
            choice = self.tool_choice
            if choice is not None:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                    "type": "function", "function": {"name": choice.name}}
                if choice.disable_parallel_tool_use:
                    body["parallel_tool_calls"] = False
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt.schema_, "strict": True}}
        return body


class MessagesRequest(MessagesBase):
    """POST /v1/messages. `max_tokens` is required, as Anthropic requires it; it is a ceiling:
    a reply that reaches the end of the context first stops with
    "model_context_window_exceeded"."""

    max_tokens: int = Field(ge=1, le=2**31 - 1)
    stop_sequences: Annotated[list[StopSequence], Field(max_length=MAX_STOP)] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: AnthropicMetadata | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> "MessagesRequest":
        # As Anthropic: the thinking budget is part of max_tokens, and leaves room to answer.
        if self.thinking_enabled and self.thinking.budget_tokens >= self.max_tokens:
            raise InvalidRequestError(
                f"max_tokens ({self.max_tokens}) must be greater than thinking.budget_tokens "
                f"({self.thinking.budget_tokens})", param="thinking.budget_tokens")
        return self

    def to_chat_request(self) -> dict[str, Any]:
        body = super().to_chat_request()
        # max_tokens is left open here: the server caps the room the prompt leaves by it.
        body.update(stop=self.stop_sequences or None, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k)
        return {k: v for k, v in body.items() if v is not None}


class CountTokensRequest(MessagesBase):
    """POST /v1/messages/count_tokens: the prompt's fields; the generation fields of a
    whole Messages body are accepted and do not change the count."""

    max_tokens: int | None = None
    stop_sequences: list[Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None


# Chat-path field names in errors -> the Messages field a client sent.
_CHAT_PARAMS = {
    "messages": "messages",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "response_format": "output_config.format",
    "stop": "stop_sequences",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "reasoning_effort": "thinking",
    "thinking_token_budget": "thinking.budget_tokens",
}


def messages_param(param: str | None) -> str | None:
    """The Messages field behind a chat-path error's `param`."""
    if param is None:
        return None
    if param.startswith("tools["):
        index, _, rest = param.partition("]")
        field = {".function.parameters": ".input_schema", ".function.name": ".name"}.get(rest.split("[")[0], "")
        return index + "]" + field
    head = param.split("[", 1)[0].split(".", 1)[0]
    return _CHAT_PARAMS.get(head, param)


# ---- the reply ----------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(num_prompt: int, num_cached: int, num_output: int) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens computed for this request,
    `cache_read_input_tokens` those served from the prefix cache (their sum is the prompt,
    what count_tokens gives); nothing is written to a cache on request, so creation is 0."""
    return {"input_tokens": num_prompt - num_cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": num_cached, "output_tokens": num_output}


def message_object(message_id: str, model: str, content: list[dict[str, Any]], stop_reason: str | None,
                   stop_sequence: str | None, usage_info: dict[str, Any]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage_info}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments text as a tool_use block's `input`. A call cut short (max_tokens)
    or written as something other than an object reads as {}."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}

"""POST /tokenize and POST /detokenize, in vLLM's and llama.cpp's forms on the same routes.

/tokenize takes exactly one input, which picks the form:

- `prompt` (vLLM): the text's token ids, with `add_special_tokens` (default true) and
  `return_token_strs` (the tokenizer's own token strings, `token_strs`). Answers `{"tokens",
  "count", "max_model_len", "token_strs"}`.
- `messages` (vLLM): the chat prompt's token ids, rendered exactly as POST
  /v1/chat/completions renders it - the server's chat template, and `tools` (with
  `tool_choice`: "none" leaves them out, as chat does) - so `count` equals that request's
  `usage.prompt_tokens`. Same answer as `prompt`.
- `content` (llama.cpp): text, or a list of texts and token ids; `add_special` (default
  false), `parse_special` (default true: special tokens written in the text are those
  tokens) and `with_pieces`. Answers `{"tokens": [ids]}`, or with pieces `{"tokens":
  [{"id", "piece"}]}`, a piece being the token's text, or its bytes as a list of integers
  when they are not valid UTF-8 on their own (part of a character), as llama.cpp answers.

A field of another form than the request's is a 400 naming it, not ignored.

/detokenize takes `tokens` in both servers' forms, which are the same request; the answer
carries the text under both names: `prompt` (vLLM) and `content` (llama.cpp).
"""

from __future__ import annotations

import functools
import re
from typing import Any, ClassVar, Literal, Mapping

from fastapi import Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field, field_validator, model_validator

from server.errors import InvalidRequestError
from server.protocol import (
    MAX_TOOLS,
    RESERVED_TEMPLATE_KWARGS,
    Messages,
    NamedToolChoice,
    Refusal,
    Tool,
    TokenId,
    ToolChoiceMode,
    _refuse_fields,
    _Request,
    _Response,
)
from server.serving import OpenAIServing, json_response, read_request
from server.serving_chat import ChatServing, render_chat, template_tools

_FORM_FIELDS: Mapping[str, tuple[str, ...]] = {
    "prompt": ("add_special_tokens", "return_token_strs"),
    "messages": ("tools", "tool_choice", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                 "return_token_strs", "chat_template_kwargs"),
    "content": ("add_special", "parse_special", "with_pieces"),
}
"""The fields each input takes; another form's field is a 400."""


class TokenizeRequest(_Request):
    """One of `prompt`, `messages` (vLLM's forms) or `content` (llama.cpp's); see the module."""

    REFUSED_FIELDS: ClassVar[Mapping[str, Refusal]] = {
        "chat_template": Refusal("a per-request chat template is not implemented (the server's template is used)"),
        "mm_processor_kwargs": Refusal("this model takes text only"),
    }
    # Published in /openapi.json: exactly one of the inputs (checked by _one_form).
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
        {"required": ["content"], "properties": {"content": {"anyOf": [
            {"type": "string"}, {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}]}}},
    ]})

    model: str | None = None
    # vLLM's forms
    prompt: str | None = None
    messages: Messages | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceMode | NamedToolChoice | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    """`messages`: extra chat-template variables, as on the chat route (e.g. `enable_thinking`)."""
    add_special_tokens: bool | None = None
    """`prompt`: add the tokenizer's special tokens (default true). `messages`: false only;
    the chat template writes them, as on the chat route."""
    return_token_strs: bool = False
    # llama.cpp's form
    content: str | list[str | TokenId] | None = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        _refuse_fields(data, cls.REFUSED_FIELDS)
        return data

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)  # as the chat route refuses them
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: the request's own fields do")
        return kwargs

    @model_validator(mode="after")
    def _one_form(self) -> "TokenizeRequest":
        given = [name for name in _FORM_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'prompt', 'messages' (vLLM's forms) or 'content' (llama.cpp's)")
        form = given[0]
        for name in self.model_fields_set:
            owners = [f for f, fields in _FORM_FIELDS.items() if name in fields]
            if owners and form not in owners:
                raise InvalidRequestError(
                    f"{name} goes with {' or '.join(repr(o) for o in owners)}; this request tokenizes {form!r}",
                    param=name,
                )
        if form == "messages" and self.add_special_tokens:
            raise InvalidRequestError(
                "add_special_tokens must be false with messages: the chat template writes the special tokens",
                param="add_special_tokens",
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message needs add_generation_prompt to be false",
                                      param="continue_final_message")
        return self

    @property
    def form(self) -> Literal["prompt", "messages", "content"]:
        return "prompt" if self.prompt is not None else "messages" if self.messages is not None else "content"


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(_Response):
    """vLLM's answer."""

    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None
    """The tokenizer's own strings of the tokens (`return_token_strs`), else null (as vLLM)."""


class TokenPiece(_Response):
    id: int
    piece: str | list[int]
    """The token's text, or its bytes when they are not valid UTF-8 on their own."""


class LlamaCppTokenizeResponse(_Response):
    """llama.cpp's answer: ids, or ids with pieces (`with_pieces`)."""

    tokens: list[int] | list[TokenPiece]


class DetokenizeResponse(_Response):
    prompt: str
    """vLLM's name of the text."""
    content: str
    """llama.cpp's name of the same text."""


# ---- token pieces -----------------------------------------------------------------------------
@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the
    others are shifted to 256 + i (e.g. the space to "Ġ")."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any, token_id: int, byte_level: bool, special_ids: frozenset[int]) -> bytes:
    """The bytes a token stands for: a special token's text; a byte-fallback token's
    ("<0xE4>") byte; a byte-level token's bytes through GPT-2's alphabet; else its text."""
    text = tokenizer.convert_ids_to_tokens(token_id)
    if token_id in special_ids or text is None:
        return (text or "").encode("utf-8")
    if match := _BYTE_FALLBACK.fullmatch(text):
        return bytes([int(match.group(1), 16)])
    chars = _byte_level_chars()
    if byte_level and all(ch in chars for ch in text):
        return bytes(chars[ch] for ch in text)
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode("utf-8")


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()


# ---- the routes -------------------------------------------------------------------------------
class TokenizeServing:
    def __init__(self, serving: OpenAIServing, chat_serving: ChatServing) -> None:
        self.serving = serving
        self.chat_serving = chat_serving

    async def tokenize(self, request: Request) -> Response:
        serving = self.serving
        req = await read_request(request, TokenizeRequest, serving.config.max_body_bytes)
        serving.check_model(req.model)
        if req.form == "content":
            return json_response(await serving.tokenizers.run(self._llamacpp_tokens, req))
        tokens, token_strs = await serving.tokenizers.run(self._vllm_tokens, req)
        return json_response(TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=serving.max_model_len,
                                              token_strs=token_strs))

    async def detokenize(self, request: Request) -> Response:
        serving = self.serving
        req = await read_request(request, DetokenizeRequest, serving.config.max_body_bytes)
        serving.check_model(req.model)
        self._check_ids(req.tokens, "tokens")
        text = await serving.tokenizers.run(
            lambda tokenizer: tokenizer.decode(req.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )
        return json_response(DetokenizeResponse(prompt=text, content=text))

    def _check_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.serving.vocab_size
        if token_ids and max(token_ids) >= vocab_size:
            raise InvalidRequestError(f"{param}: token ids must be in [0, {vocab_size})", param=param)

    def _vllm_tokens(self, tokenizer: Any, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        if req.messages is not None:
            # As the chat route renders them (server/serving_chat.py), so the counts agree.
            tools = template_tools(req.tools) if req.tool_choice != "none" else None
            tokens = render_chat(tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message,
                                 tools, self.chat_serving.chat_template, req.chat_template_kwargs)
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = tokenizer.encode(req.prompt, add_special_tokens=add_special)
        return tokens, (tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None)

    def _llamacpp_tokens(self, tokenizer: Any, req: TokenizeRequest) -> LlamaCppTokenizeResponse:
        # llama.cpp's mixed prompt: texts tokenized in turn (special tokens added to the first
        # only), token ids taken as they are.
        parts = [req.content] if isinstance(req.content, str) else list(req.content or [])
        tokens: list[int] = []
        for i, part in enumerate(parts):
            if isinstance(part, int):
                tokens.append(part)
            else:
                tokens += tokenizer.encode(part, add_special_tokens=req.add_special and i == 0,
                                           split_special_tokens=not req.parse_special)
        self._check_ids(tokens, "content")
        if not req.with_pieces:
            return LlamaCppTokenizeResponse(tokens=tokens)
        byte_level, special_ids = _is_byte_level(tokenizer), frozenset(tokenizer.all_special_ids)
        return LlamaCppTokenizeResponse(tokens=[
            TokenPiece(id=t, piece=_piece(token_bytes(tokenizer, t, byte_level, special_ids))) for t in tokens
        ])

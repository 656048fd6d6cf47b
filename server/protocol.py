"""Pydantic models of the OpenAI completion and chat protocol (requests, responses, chunks).

Requests validate strictly (a string is not a number, `true` is not 1, NaN and infinity
are refused) and ignore unknown fields, as vLLM does. Bounds that cap fan-out live here as
field constraints, so a violation names its field; limits that depend on the model (vocab,
context, the server's `n` cap) are checked by the server.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator

from engine.outputs import Logprob
from server.errors import InvalidRequestError

MAX_PROMPTS = 64
"""Most prompts in one completions request (a list of strings or of token-id lists)."""
MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
MAX_SEED = 2**63 - 1
MAX_CACHE_SALT_LEN = 1024
"""The salt is hashed into every prompt block's cache key: keep it short."""
# Logprobs JSON cannot carry -inf; vLLM reports impossible tokens as -9999.0 too.
_MIN_LOGPROB = -9999.0

StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_LEN)]
BiasValue = Annotated[float, Field(ge=-100, le=100)]
TokenId = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(allow_inf_nan=True)


# ---- requests ----------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """The sampling and stopping fields completions and chat share (OpenAI + vLLM names)."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=MAX_SEED)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    logit_bias: Annotated[dict[str, BiasValue], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_LEN)
    """vLLM's name: requests reuse each other's cached prompt blocks only when their salts match."""

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, stream_options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # As OpenAI and vLLM: options for a stream that will not happen are a mistake.
        if stream_options is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return stream_options

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, prompt: Any) -> Any:
        # Checked before the union so the message says what a prompt may be, not which
        # union member failed where.
        if isinstance(prompt, str):
            return prompt
        shape = "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        if not isinstance(prompt, list):
            raise ValueError(shape)
        if not prompt:
            raise ValueError("must not be empty")
        if all(_is_token_id(t) for t in prompt):
            return prompt
        if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
            raise ValueError(shape)
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        for i, seq in enumerate(prompt):
            if isinstance(seq, list) and not seq:
                raise ValueError(f"prompt {i} is an empty token-id list")
            if isinstance(seq, list) and not all(_is_token_id(t) for t in seq):
                raise ValueError(f"prompt {i}: token ids must be integers >= 0")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list: one entry per prompt, a string or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


class ContentPart(_Request):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type != "text":
            raise ValueError(f"content part type {self.type!r} is not supported (only 'text')")
        if self.text is None:
            raise ValueError("a text content part needs 'text'")
        return self


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # vLLM's "string" content format: text parts joined by newlines.
        return "\n".join(part.text or "" for part in self.content)

    def for_template(self) -> dict[str, str]:
        # Templates know system/user/assistant; "developer" is OpenAI's new name for system.
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        return message


Messages = Annotated[list[ChatMessage], Field(min_length=1)]


class ChatCompletionRequest(SamplingRequest):
    messages: Messages
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    # Field validators (not a model validator) so that the error names its field; fields
    # validate in declaration order, so `info.data` already holds the ones above.
    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top_logprobs

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_generate(cls, continue_final_message: bool, info: ValidationInfo) -> bool:
        if continue_final_message and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message needs add_generation_prompt to be false")
        return continue_final_message

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    # Published in /openapi.json: exactly one of the two inputs (checked by _one_input).
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]})

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# ---- the request body: strict JSON ------------------------------------------------------------
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        raise InvalidRequestError("the request body is empty; expected a JSON object")
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
    except UnicodeDecodeError as e:
        raise InvalidRequestError("the request body is not valid UTF-8") from e
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from e
    except (ValueError, RecursionError) as e:
        raise InvalidRequestError(f"invalid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    # Lone surrogates only arrive as \ud800-style escapes (strict UTF-8 cannot carry them),
    # so the walk runs only when the body has such an escape; valid pairs pass it.
    if _SURROGATE_ESCAPE.search(body):
        where = _find_lone_surrogate(obj)
        if where is not None:
            raise InvalidRequestError(f"{where} contains a lone UTF-16 surrogate (invalid Unicode)", param=where)
    return obj


def _find_lone_surrogate(obj: Any) -> str | None:
    """Path of the first string (or key) that cannot be encoded as UTF-8, else None."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
                stack.append((child, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value) if isinstance(item, (str, list, dict)))
    return None



# ---- responses -----------------------------------------------------------------------------
class PromptTokensDetails(_Response):
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of being computed."""


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    """The legacy completions format: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(None, exclude_if=lambda v: v is None)


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatStreamChoice(_Response):
    index: int
    delta: dict[str, str]
    """`{"role": "assistant", "content": ""}` first, then `{"content": ...}`, `{}` last."""
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = Field(None, exclude_if=lambda v: v is None)


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagoda"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Response):
    prompt: str


# ---- logprobs in the two OpenAI formats ----------------------------------------------------------
def _finite(logprob: float) -> float:
    return logprob if logprob > _MIN_LOGPROB else _MIN_LOGPROB


def _token_text(token_id: int, lp: Logprob, hidden_ids: frozenset[int]) -> str:
    # With skip_special_tokens the text leaves out special tokens (EOS ends most chats), so
    # their logprob entries read "" too and the tokens still add up to the text (as vLLM).
    return "" if token_id in hidden_ids else lp.decoded_token


def completion_logprobs(
    token_logprobs: list[dict[int, Logprob]],
    text_offset: int,
    hidden_ids: frozenset[int] = frozenset(),
    into: CompletionLogprobs | None = None,
) -> tuple[CompletionLogprobs, int]:
    """Legacy completions logprobs for a run of tokens; returns them and the next text offset.

    Each dict holds the sampled token first, then the top-k alternatives (vLLM's shape:
    top_logprobs has k entries, k + 1 when the sampled token is not among them).
    `hidden_ids`: tokens shown as "" (the special tokens, when the text skips them).
    `into`: append to these (the echoed prompt's entries) instead of starting empty.
    """
    out = into if into is not None else CompletionLogprobs()
    for entry in token_logprobs:
        sampled_id, sampled = next(iter(entry.items()))
        token = _token_text(sampled_id, sampled, hidden_ids)
        out.tokens.append(token)
        out.token_logprobs.append(_finite(sampled.logprob))
        out.top_logprobs.append({_token_text(t, lp, hidden_ids): _finite(lp.logprob) for t, lp in entry.items()})
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out, text_offset


def echo_logprobs(first_token: str, prompt_logprobs: list[dict[int, Logprob] | None]) -> tuple[CompletionLogprobs, int]:
    """The echoed prompt's entries in the legacy format, and the text offset after them.

    Nothing predicts the first token, so its logprob and top_logprobs are null (as OpenAI);
    each later entry holds the prompt token first, then the top-k alternatives. The prompt
    is echoed verbatim, so its special tokens keep their text.
    """
    out = CompletionLogprobs(text_offset=[0], token_logprobs=[None], tokens=[first_token], top_logprobs=[None])
    return completion_logprobs(prompt_logprobs[1:], len(first_token), into=out)  # type: ignore[arg-type]


def chat_logprobs(
    token_logprobs: list[dict[int, Logprob]], top_k: int, hidden_ids: frozenset[int] = frozenset()
) -> ChatChoiceLogprobs:
    content = []
    for entry in token_logprobs:
        sampled_id, sampled = next(iter(entry.items()))
        # The k best by rank: the sampled token is in them only if its rank is <= k.
        top = sorted(entry.items(), key=lambda item: item[1].rank)[:top_k] if top_k else []
        token = _token_text(sampled_id, sampled, hidden_ids)
        alternatives = []
        for t, lp in top:
            text = _token_text(t, lp, hidden_ids)
            alternatives.append(ChatTopLogprob(token=text, logprob=_finite(lp.logprob), bytes=list(text.encode("utf-8"))))
        content.append(
            ChatTokenLogprob(
                token=token, logprob=_finite(sampled.logprob), bytes=list(token.encode("utf-8")), top_logprobs=alternatives
            )
        )
    return ChatChoiceLogprobs(content=content)

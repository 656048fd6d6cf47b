"""Pydantic models of the OpenAI completion and chat protocol (requests, responses, chunks).

Requests validate strictly (a string is not a number, `true` is not 1, NaN and infinity
are refused). Bounds that cap fan-out live here as field constraints, so a violation names
its field; limits that depend on the model (vocab, context, the server's `n` cap) are
checked by the server.

Nothing a client sends is silently dropped. Every OpenAI request field is one of:

- implemented (sampling, stopping, logprobs, `response_format`, tools, ...);
- accepted as a documented no-op, when it cannot change what a local model generates
  (`user`, `store`, `metadata`, ... - see `SamplingRequest`);
- refused with a 400 whose `param` names it (`REFUSED_FIELDS` of each request model:
  `audio`, `prediction`, `web_search_options`, chat-only fields sent to completions, and
  the vLLM extensions this server does not implement, unless they hold vLLM's default).

Fields that are neither OpenAI's nor vLLM's are ignored, as vLLM does, but each such name
is logged once per process (`log_unknown_fields`, called by `server.serving.parse_request`).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import threading
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Mapping

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from engine.outputs import Logprob
from engine.structured_output.spec import GrammarError, StructuredOutputSpec
from server.errors import InvalidRequestError
from server.protocol_llamacpp import REFUSED_LLAMACPP, LlamaCppRequestFields
from server.protocol_vllm import PromptLogprobs, VllmRequestFields, token_id_string

logger = logging.getLogger("pagoda.server")

MAX_PROMPTS = 64
"""Most prompts in one completions request (a list of strings or of token-id lists)."""
MAX_LOGPROBS = 20
"""The default of --max-logprobs (OpenAI's limit): the most logprobs per token a request may ask for."""
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300
MAX_SEED = 2**63 - 1
MAX_CACHE_SALT_LEN = 1024
"""The salt is hashed into every prompt block's cache key: keep it short."""
MAX_TOOLS = 128
"""Most tools (or legacy functions) in one chat request, as OpenAI."""
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_LEN = 64
MAX_METADATA_VALUE_LEN = 512
# Logprobs JSON cannot carry -inf; vLLM reports impossible tokens as -9999.0 too.
_MIN_LOGPROB = -9999.0

StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_LEN)]
BiasValue = Annotated[float, Field(ge=-100, le=100)]
TokenId = Annotated[int, Field(ge=0)]
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY_LEN)],
         Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE_LEN)]],
    Field(max_length=MAX_METADATA_PAIRS),
]
"""`metadata` under OpenAI's limits: 16 pairs, keys of at most 64 characters, values of 512
(stored responses keep it, so it must not grow without bound)."""
FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
"""OpenAI's rule for tool (function) names: 1-64 letters, digits, '_' or '-'."""


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(allow_inf_nan=True)


# ---- refused fields ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request field is refused, and which values mean "not asked for"."""

    reason: str
    unused: tuple[Any, ...] = (None,)
    """Values that pass: null, or the vLLM default of a vLLM extension (clients that send
    every field with its default value must keep working)."""

    def refuses(self, value: Any) -> bool:
        # `type(...) is` so that 0 is not False and 1.0 is not True.
        return not any(value is u or (type(value) is type(u) and value == u) for u in self.unused)


def _refuse_fields(data: Any, refused: Mapping[str, Refusal]) -> None:
    """400 naming the first refused field `data` uses.

    Raised as InvalidRequestError, not ValueError: pydantic passes other exceptions through
    its validators untouched, so the error keeps its `param` (a model-level ValueError would
    have no field to name).
    """
    if not isinstance(data, dict):
        return
    for name, refusal in refused.items():
        if name in data and refusal.refuses(data[name]):
            raise InvalidRequestError(f"{name} is not supported: {refusal.reason}", param=name)


_NOT_IMPLEMENTED_VLLM = "a vLLM extension this server does not implement"
REFUSED_COMMON: Mapping[str, Refusal] = {
    # OpenAI
    "audio": Refusal("this server generates text only (no audio output)"),
    "prediction": Refusal("predicted outputs are not implemented"),
    "web_search_options": Refusal("this server has no web search"),
    # vLLM extensions, refused unless they hold vLLM's default
    "allowed_token_ids": Refusal(f"{_NOT_IMPLEMENTED_VLLM} (logit_bias can do the same)"),
    "bad_words": Refusal(f"{_NOT_IMPLEMENTED_VLLM} (stop or logit_bias may help)", (None, [])),
    "spaces_between_special_tokens": Refusal(_NOT_IMPLEMENTED_VLLM, (None, True)),
    "logits_processors": Refusal(_NOT_IMPLEMENTED_VLLM),
    "structural_tag": Refusal("structural tags are not implemented"),
    "guided_whitespace_pattern": Refusal("a custom JSON whitespace pattern is not implemented"),
    "kv_transfer_params": Refusal("disaggregated serving is not implemented"),
    "vllm_xargs": Refusal(_NOT_IMPLEMENTED_VLLM),
    # vLLM names the response (and its engine request) by it; here ids are the server's own.
    "request_id": Refusal(f"{_NOT_IMPLEMENTED_VLLM} (the response's id is the server's own)"),
    # llama.cpp's own fields (server/protocol_llamacpp.py)
    **{name: Refusal(reason, unused) for name, (reason, unused) in REFUSED_LLAMACPP.items()},
}
_CHAT_FIELD = "it is a chat completions field (POST /v1/chat/completions)"
REFUSED_COMPLETION_ONLY: Mapping[str, Refusal] = {
    "messages": Refusal(f"{_CHAT_FIELD}; completions take a prompt"),
    "tools": Refusal(_CHAT_FIELD),
    "tool_choice": Refusal(_CHAT_FIELD),
    "parallel_tool_calls": Refusal(_CHAT_FIELD),
    "functions": Refusal(_CHAT_FIELD),
    "function_call": Refusal(_CHAT_FIELD),
    "max_completion_tokens": Refusal(f"{_CHAT_FIELD}; completions use max_tokens"),
    "top_logprobs": Refusal(f"{_CHAT_FIELD}; completions use logprobs (an integer)"),
    "add_generation_prompt": Refusal(_CHAT_FIELD, (None, True)),
    "continue_final_message": Refusal(_CHAT_FIELD, (None, False)),
    "prompt_embeds": Refusal("prompts are text or token ids"),
    "add_special_tokens": Refusal(_NOT_IMPLEMENTED_VLLM, (None, True)),
    "chat_template_kwargs": Refusal(f"{_CHAT_FIELD}; completions have no chat template", (None, {})),
    "thinking_token_budget": Refusal(f"{_CHAT_FIELD}; completions do not separate a model's thinking"),
    "max_reasoning_tokens": Refusal(f"{_CHAT_FIELD}; completions do not separate a model's thinking"),
}
REFUSED_CHAT_ONLY: Mapping[str, Refusal] = {
    "best_of": Refusal("it is a completions field (POST /v1/completions)", (None, 1)),
    "suffix": Refusal("it is a completions field, and suffix is not implemented"),
    "prompt": Refusal("it is a completions field; chat takes messages"),
    "add_special_tokens": Refusal(_NOT_IMPLEMENTED_VLLM, (None, False)),
    "chat_template": Refusal("a per-request chat template is not implemented (the server's template is used)"),
    "documents": Refusal(_NOT_IMPLEMENTED_VLLM),
    "mm_processor_kwargs": Refusal("this model takes text only"),
    "media_io_kwargs": Refusal("this model takes text only"),
}


# ---- structured outputs ----------------------------------------------------------------------
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
GUIDED_DECODING_BACKENDS = ("auto", "guidance", "llguidance")
"""`guided_decoding_backend` values accepted: every one means this server's only backend,
llguidance (vLLM's name for it is "guidance")."""


class JsonSchemaFormat(_Request):
    """`response_format.json_schema`. `strict` is accepted either way: the output is always
    held to the schema exactly (OpenAI's strict mode). Unknown keys are refused: an ignored
    key here could be an ignored constraint."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """`{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object) or
    `{"type": "json_schema", "json_schema": {"name", "schema", ...}}`; llama.cpp's
    `{"type": "json_object", "schema": {...}}` is JSON matching that schema. Unknown keys
    are refused, as in `JsonSchemaFormat`."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    """llama.cpp's: with type "json_object", the schema the object must match."""

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, data: Any) -> Any:
        # Before the Literal check, so that the message lists the types and names the field.
        if isinstance(data, dict) and data.get("type") not in RESPONSE_FORMAT_TYPES:
            allowed = ", ".join(repr(t) for t in RESPONSE_FORMAT_TYPES)
            got = f"got {data['type']!r}" if "type" in data else "it has none"
            raise ValueError(f"response_format type must be one of {allowed}; {got}")
        return data

    @model_validator(mode="after")
    def _schema_where_needed(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError(
                "response_format of type 'json_schema' needs json_schema.schema (the JSON schema the output must "
                "match); use type 'json_object' for any JSON object"
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format of type {self.type!r} takes no json_schema")
        if self.type != "json_object" and self.schema_ is not None:
            raise ValueError(f"response_format of type {self.type!r} takes no schema (llama.cpp's form is "
                             "{\"type\": \"json_object\", \"schema\": {...}})")
        return self


STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: exactly one of `json` (a schema, as an object or JSON
    text), `regex`, `choice`, `grammar` (Lark or GBNF), `json_object: true`.

    Unknown keys are refused (an ignored key here would be an ignored constraint).
    `disable_fallback` is accepted (there is one backend, nothing to fall back to); the
    options that would change the output but are not implemented are refused unless they
    hold vLLM's default: `disable_any_whitespace`, `disable_additional_properties`,
    `whitespace_pattern`, `structural_tag`.
    """

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: SkipJsonSchema[Any] = None
    disable_additional_properties: SkipJsonSchema[Any] = None
    whitespace_pattern: SkipJsonSchema[Any] = None
    structural_tag: SkipJsonSchema[Any] = None

    @field_validator("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "structural_tag")
    @classmethod
    def _not_implemented(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and value is not False:
            raise ValueError(f"structured_outputs.{info.field_name} is not supported by this server")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = self.constraint_keys()
        if len(given) != 1:
            found = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)} "
                             f"(json_object: true); {found}")
        return self

    def constraint_keys(self) -> list[str]:
        values = (self.json_, self.regex, self.choice, self.grammar, self.json_object or None)
        return [key for key, value in zip(STRUCTURED_OUTPUT_KEYS, values) if value is not None]


_SPEC_BUILDERS = {
    "json": StructuredOutputSpec.json_schema,
    "json_object": lambda _value, param: StructuredOutputSpec.json_object(param),
    "regex": StructuredOutputSpec.regex,
    "choice": StructuredOutputSpec.choice,
    "grammar": StructuredOutputSpec.grammar,
}
_GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                  ("guided_grammar", "grammar"), ("json_schema", "json"), ("grammar", "grammar"))
"""Top-level constraint fields: vLLM's older `guided_*`, then llama.cpp's `json_schema` and `grammar`."""


def structured_output_spec(req: "SamplingRequest") -> StructuredOutputSpec | None:
    """The engine's spec for what `req` asks its output to match, or None.

    Sources: `response_format` (json_object / json_schema; "text" is no constraint),
    `structured_outputs` (vLLM), and the older top-level `guided_json`, `guided_regex`,
    `guided_choice`, `guided_grammar`, and llama.cpp's `json_schema` and `grammar` (GBNF).
    At most one may constrain a request. The spec's
    `param` is the field it came from, for errors raised later (compilation).

    Raises InvalidRequestError (400, `param` named) for two constraints, or for one the
    spec refuses (a `guided_json` string that is not JSON, an empty regex, ...). Request
    validation already calls it, so on a parsed request it raises nothing.
    """
    found: list[tuple[str, str, Any]] = []  # (field, spec kind, value)
    rf = req.response_format
    if rf is not None and rf.type == "json_object" and rf.schema_ is not None:
        found.append(("response_format", "json", rf.schema_))  # llama.cpp's form
    elif rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", None))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        found.append(("response_format", "json", rf.json_schema.schema_))
    so = req.structured_outputs
    if so is not None:
        key = so.constraint_keys()[0]  # exactly one: StructuredOutputs checks it
        found.append(("structured_outputs", key, so.json_ if key == "json" else getattr(so, key)))
    for field, kind in _GUIDED_FIELDS:
        value = getattr(req, field)
        if value is not None:
            found.append((field, kind, value))
    if not found:
        return None
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise InvalidRequestError(
            f"a request takes at most one output constraint; this one has both {first} and {second}", param=second
        )
    field, kind, value = found[0]
    try:
        return _SPEC_BUILDERS[kind](value, field)
    except GrammarError as e:
        raise InvalidRequestError(str(e), param=e.param or field) from e


# ---- requests ----------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with `include_usage`, every chunk carries the usage so far (its choice's
    completion tokens); without `include_usage` it does nothing, as in vLLM."""
    include_obfuscation: bool | None = None
    """OpenAI's: pads deltas with an `obfuscation` field against side channels. A no-op: no
    padding is sent (it cannot change the generated text)."""


class SamplingRequest(_Request, VllmRequestFields, LlamaCppRequestFields):
    """The fields completions and chat share (OpenAI + vLLM names).

    Accepted no-ops - OpenAI fields that cannot change what a local model generates, so
    they are validated and then unused: `user`, `store` (nothing is stored), `metadata`,
    `service_tier` (one tier), `reasoning_effort` (except "none", which turns a reasoning
    model's thinking off in chat where its template can: server/reasoning.py) and `verbosity`
    (no verbosity control), `prompt_cache_key` and `prompt_cache_retention` (the
    prefix cache is automatic, keyed by content and `cache_salt`), `safety_identifier`,
    `modalities` (only `["text"]`), `guided_decoding_backend` (one backend).
    Refused when used: `REFUSED_FIELDS` (400 naming the field). vLLM's prompt logprobs,
    token ids and prompt truncation: `VllmRequestFields` (server/protocol_vllm.py); llama.cpp's
    `n_predict`, `json_schema` and `grammar`: `LlamaCppRequestFields` (server/protocol_llamacpp.py).
    """

    REFUSED_FIELDS: ClassVar[Mapping[str, Refusal]] = REFUSED_COMMON

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
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_LEN)
    """vLLM's name: requests reuse each other's cached prompt blocks only when their salts match."""
    priority: int | None = Field(None, ge=-1000, le=1000)
    """vLLM's scheduling priority: lower is scheduled first (`--scheduling-policy fair`); with a
    named API key, no lower than the key's priority; none: the key's priority, or 0."""
    use_beam_search: bool | None = None
    """vLLM's: the `n` best sequences of a beam search of width `n` (engine/beam_search.py)."""
    length_penalty: float | None = None
    """vLLM's, for beam search: a finished beam scores log-probability / length ** length_penalty."""

    # What the output must match (see structured_output_spec).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["auto", "guidance", "llguidance"] | None = None

    # Accepted no-ops (see the class docstring).
    user: str | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    safety_identifier: str | None = None
    modalities: Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        _refuse_fields(data, cls.REFUSED_FIELDS)
        return data

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, stream_options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # As OpenAI and vLLM: options for a stream that will not happen are a mistake.
        if stream_options is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return stream_options

    # Before the types: the messages say why, and name the whole field.
    @field_validator("guided_decoding_backend", mode="before")
    @classmethod
    def _known_backend(cls, backend: Any) -> Any:
        if backend is not None and backend not in GUIDED_DECODING_BACKENDS:
            raise ValueError(
                f"guided_decoding_backend must be one of {', '.join(GUIDED_DECODING_BACKENDS)} (this server's only "
                f"backend is llguidance), got {backend!r}"
            )
        return backend

    @field_validator("modalities", mode="before")
    @classmethod
    def _text_only(cls, modalities: Any) -> Any:
        if modalities is not None and modalities != ["text"]:
            raise ValueError(f'modalities: this model generates text only; the one accepted value is ["text"], '
                             f"got {modalities!r}")
        return modalities

    @model_validator(mode="after")
    def _one_output_constraint(self) -> "SamplingRequest":
        # Builds the spec once to check it (two constraints, a schema that is not JSON);
        # raises InvalidRequestError with its param, which pydantic passes through.
        structured_output_spec(self)
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's `continuous_usage_stats`, only with `include_usage`)."""
        return self.include_usage and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `best_of`: that many samples per prompt, the `n` with the
    highest cumulative logprob returned (server/serving_completion.py); not with `stream`."""

    REFUSED_FIELDS: ClassVar[Mapping[str, Refusal]] = {**REFUSED_COMMON, **REFUSED_COMPLETION_ONLY}

    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0)
    """At most --max-logprobs (checked by the server)."""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

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

    @field_validator("best_of")
    @classmethod
    def _best_of_covers_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n")
        if best_of is None or n is None:  # n missing: it failed its own validation
            return best_of
        if best_of < n:
            raise ValueError(f"best_of must be >= n ({n}), got {best_of}")
        if best_of > n and info.data.get("stream"):
            # As OpenAI: the best samples are known only once all of them have finished.
            raise ValueError("best_of cannot be used with stream (the best samples are known only at the end)")
        return best_of

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list: one entry per prompt, a string or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    @property
    def samples_per_prompt(self) -> int:
        """How many samples the engine runs per prompt: best_of when given, else n."""
        return self.best_of if self.best_of is not None else self.n


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


# ---- chat messages ----------------------------------------------------------------------------
class ContentPart(_Request):
    """One part of a message's content. Only text is taken (`_check_messages` refuses the
    rest with the message's index); an assistant's `refusal` part counts as its text.
    Published as a text part, the one every role takes."""

    model_config = ConfigDict(json_schema_extra=lambda schema: schema.update({
        "properties": {"type": {"const": "text", "type": "string"}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }))

    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionCall(_Request):
    """A call the assistant made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


def _message_schema(schema: dict[str, Any]) -> None:
    """Publish, per role, what `_check_messages` lets a message carry (clients, API tools
    and the fuzz test read /openapi.json)."""
    props = schema["properties"]
    text = {"anyOf": [s for s in props["content"]["anyOf"] if s.get("type") != "null"]}

    def shape(roles: list[str], fields: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
        return {"type": "object", "properties": {"role": {"enum": roles, "type": "string"}, **fields},
                "required": ["role", *required]}

    name = {"type": "string", "minLength": 1}
    schema.pop("properties")
    schema.pop("required", None)
    schema["anyOf"] = [
        shape(["system", "developer", "user"], {"content": props["content"], "name": props["name"]}),
        shape(["assistant"], {k: props[k] for k in ("content", "name", "tool_calls", "function_call", "refusal")}),
        shape(["tool"], {"content": text, "tool_call_id": name, "name": props["name"]}, ("content", "tool_call_id")),
        shape(["function"], {"content": props["content"], "name": name}, ("name",)),
    ]


class ChatMessage(_Request):
    """One message. Beyond plain text: an assistant's `tool_calls` (its content may then be
    null), `tool` messages answering them (`tool_call_id`), and the legacy `function_call`
    / `function` messages. Checked as a list by `_check_messages`."""

    model_config = ConfigDict(json_schema_extra=_message_schema)

    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None
    refusal: str | None = None
    """An assistant's refusal (OpenAI): stands for its text when `content` is null."""
    reasoning_content: str | None = None
    """An assistant's thinking (a reasoning model's earlier reply), for templates that show
    it; `reasoning` is vLLM's newer name for it."""
    reasoning: str | None = None
    audio: SkipJsonSchema[Any] = None
    """A previous audio answer: refused (text only)."""

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        # vLLM's "string" content format: text parts joined by newlines.
        return "\n".join((part.text if part.type == "text" else part.refusal) or "" for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: role, content (text), and where present
        `name`, `tool_calls` (`[{"id", "type": "function", "function": {"name",
        "arguments"}}]`, arguments as the JSON text the client sent) and `tool_call_id`.

        "developer" (OpenAI's new name for system) becomes "system"; the legacy function
        calling becomes tool history: an assistant's `function_call` is a one-entry
        `tool_calls` (without an id) and a "function" message is a "tool" message.
        """
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls
            ]
        elif self.function_call is not None:
            fc = self.function_call
            message["tool_calls"] = [{"type": "function", "function": {"name": fc.name, "arguments": fc.arguments}}]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None and role == "assistant":
            message["reasoning_content"] = thinking  # Qwen3's template shows it for turns after the last query
        return message


def _check_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """What a single message's fields cannot say: which role may carry what, and text-only
    content. Errors name `messages` and say which message (and part)."""
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.audio is not None:
            raise ValueError(f"{where}: audio is not supported: this model takes text only")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type == "text":
                    if part.text is None:
                        raise ValueError(f"{where}.content[{j}]: a text content part needs 'text'")
                elif part.type == "refusal" and m.role == "assistant":
                    if part.refusal is None:
                        raise ValueError(f"{where}.content[{j}]: a refusal content part needs 'refusal'")
                else:
                    raise ValueError(
                        f"{where}.content[{j}]: content parts of type {part.type!r} are not supported: this model "
                        "takes text only (parts of type 'text')"
                    )
        if m.role != "assistant":
            for field in ("tool_calls", "function_call", "refusal", "reasoning_content", "reasoning"):
                if getattr(m, field) is not None:
                    raise ValueError(f"{where}: only assistant messages have {field} (this one is {m.role!r})")
        elif m.tool_calls is not None and m.function_call is not None:
            raise ValueError(f"{where}: give tool_calls or the deprecated function_call, not both")
        if m.role == "tool":
            if not m.tool_call_id:
                raise ValueError(f"{where}: a 'tool' message needs 'tool_call_id' (the id of the tool call it answers)")
            if m.content is None:
                raise ValueError(f"{where}: a 'tool' message needs content (the tool's result)")
        elif m.tool_call_id is not None:
            raise ValueError(f"{where}: only 'tool' messages have tool_call_id (this one is {m.role!r})")
        if m.role == "function" and not m.name:
            raise ValueError(f"{where}: a 'function' message needs 'name' (the function whose result it is)")
    return messages


Messages = Annotated[list[ChatMessage], Field(min_length=1), AfterValidator(_check_messages)]


# ---- tools ------------------------------------------------------------------------------------
class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments (an object); none: the function takes no arguments."""
    strict: bool | None = None


class Tool(_Request):
    """A tool the model may call: only OpenAI's "function" tools."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """`{"type": "function", "function": {"name": ...}}`: the model must call this tool."""

    type: Literal["function"]
    function: NamedFunction


ToolChoiceMode = Literal["none", "auto", "required"]


def _refuse_non_function_types(value: Any, field: str) -> Any:
    """400 naming `field` for an entry whose type is not "function" (custom tools, web
    search, allowed_tools, ...): the models would say only "should be 'function'"."""
    for i, item in enumerate(value if isinstance(value, list) else [value]):
        if isinstance(item, dict) and item.get("type") != "function":
            where = f"{field}[{i}]" if isinstance(value, list) else field
            raise ValueError(f"{where} has type {item.get('type')!r}; only type 'function' is supported")
    return value


def _unique_names(functions: list[FunctionDefinition], field: str) -> None:
    seen: dict[str, int] = {}
    for i, f in enumerate(functions):
        if f.name in seen:
            raise ValueError(f"{field}[{i}] repeats the name {f.name!r} of {field}[{seen[f.name]}]")
        seen[f.name] = i


def _check_choice(choice: Any, names: list[str], field: str) -> None:
    """`choice` (a mode, or a named function) against the request's tool names."""
    if choice is None or choice in ("none", "auto"):
        return
    if choice == "required":
        if not names:
            raise ValueError(f"{field} 'required' needs tools to choose from; the request has none")
        return
    name = choice.function.name if isinstance(choice, NamedToolChoice) else choice.name
    if not names:
        raise ValueError(f"{field} names the function {name!r}, but the request has no tools")
    if name not in names:
        shown = ", ".join(repr(n) for n in names[:10]) + (", ..." if len(names) > 10 else "")
        raise ValueError(f"{field} names the function {name!r}, which is not among the tools ({shown})")


RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions.

    Tools: `tools` (function tools) or the deprecated `functions`, and `tool_choice` or the
    deprecated `function_call`; `effective_tools`, `effective_tool_choice` and
    `effective_parallel_tool_calls` give the one view of both spellings. A `tool_choice`
    that names a function not among the tools, or "required" without tools, is refused.
    """

    REFUSED_FIELDS: ClassVar[Mapping[str, Refusal]] = {**REFUSED_COMMON, **REFUSED_CHAT_ONLY}

    messages: Messages
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)
    """-1: the whole vocabulary (vLLM); at most --max-logprobs either way (checked by the server)."""
    echo: bool = False
    """vLLM's: the reply's content starts with the last message's, when the reply continues it
    (server/protocol_vllm.py `chat_echo_prefix`)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Tools, in this order: each validator sees the fields above it in `info.data`.
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    functions: Annotated[list[FunctionDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceMode | NamedToolChoice | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning models (server/reasoning.py).
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: extra variables for the chat template (e.g. `{"enable_thinking": false}`)."""
    thinking_token_budget: int | None = Field(None, ge=0)
    """vLLM's: most thinking tokens before the engine closes the thinking; no effect on a
    model without a reasoning parser (it has no thinking to bound)."""
    max_reasoning_tokens: int | None = Field(None, ge=0)
    """Another client's name for `thinking_token_budget`."""

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

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        return _refuse_non_function_types(tools, "tools")

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[Tool] | None) -> list[Tool] | None:
        if tools:
            _unique_names([t.function for t in tools], "tools")
        return tools

    @field_validator("functions")
    @classmethod
    def _tools_or_functions(cls, functions: list[FunctionDefinition] | None, info: ValidationInfo) -> Any:
        if functions is not None and info.data.get("tools") is not None:
            raise ValueError("give tools or the deprecated functions, not both")
        if functions:
            _unique_names(functions, "functions")
        return functions

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, tool_choice: Any) -> Any:
        return _refuse_non_function_types(tool_choice, "tool_choice")

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, tool_choice: Any, info: ValidationInfo) -> Any:
        if _tools_valid(info.data):
            _check_choice(tool_choice, _tool_names(info.data), "tool_choice")
        return tool_choice

    @field_validator("function_call")
    @classmethod
    def _function_call_among_tools(cls, function_call: Any, info: ValidationInfo) -> Any:
        if function_call is not None and info.data.get("tool_choice") is not None:
            raise ValueError("give tool_choice or the deprecated function_call, not both")
        if _tools_valid(info.data):
            _check_choice(function_call, _tool_names(info.data), "function_call")
        return function_call

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        # These name the template call's own arguments or the conversation, not variables.
        taken = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: the request's own fields do")
        return kwargs

    @field_validator("max_reasoning_tokens")
    @classmethod
    def _one_thinking_budget(cls, budget: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("thinking_token_budget")
        if budget is not None and other is not None and budget != other:
            raise ValueError("max_reasoning_tokens and thinking_token_budget are one setting; give one")
        return budget

    @property
    def thinking_budget(self) -> int | None:
        return self.thinking_token_budget if self.thinking_token_budget is not None else self.max_reasoning_tokens

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def effective_tools(self) -> list[Tool] | None:
        """`tools`, or the deprecated `functions` as function tools; None when there are none."""
        if self.tools:
            return list(self.tools)
        if self.functions:
            return [Tool(type="function", function=f) for f in self.functions]
        return None

    @property
    def effective_tool_choice(self) -> ToolChoiceMode | NamedToolChoice:
        """"none", "auto", "required" or the named function the model must call, from
        `tool_choice` or the deprecated `function_call`. As OpenAI, the default is "auto"
        with tools; without tools it is always "none"."""
        if not self.effective_tools:
            return "none"
        choice: Any = self.tool_choice
        if choice is None and self.function_call is not None:
            fc = self.function_call
            choice = fc if isinstance(fc, str) else NamedToolChoice(type="function", function=fc)
        return "auto" if choice is None else choice

    @property
    def effective_parallel_tool_calls(self) -> bool:
        """Whether the model may call several tools in one turn (OpenAI's default: yes)."""
        return self.parallel_tool_calls is not False

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        """The effective tools as chat templates take them (`tools=` of apply_chat_template):
        `[{"type": "function", "function": {"name", "description"?, "parameters"?}}]`."""
        tools = self.effective_tools
        if tools is None:
            return None
        return [
            {"type": "function", "function": t.function.model_dump(exclude_none=True, exclude={"strict"})} for t in tools
        ]


def _tools_valid(data: dict[str, Any]) -> bool:
    """Whether tools and functions passed validation (a failed field is missing from
    `info.data`): otherwise a choice cannot be checked against them, and their own error
    is the one to report."""
    return "tools" in data and "functions" in data


def _tool_names(data: dict[str, Any]) -> list[str]:
    """The names of the tools (or functions) validated so far."""
    tools = data.get("tools") or []
    functions = data.get("functions") or []
    return [t.function.name for t in tools] + [f.name for f in functions]


# ---- unknown fields: ignored, logged once per name -------------------------------------------------
MAX_UNKNOWN_FIELDS_LOGGED = 256
"""Distinct unknown field names logged per process; past it, clients inventing names
cannot grow the log (or this set) any further."""
_MAX_LOGGED_NAME_LEN = 80
_logged_unknown: set[tuple[str, str]] = set()
_logged_unknown_lock = threading.Lock()


@functools.cache
def known_fields(model: type[BaseModel]) -> frozenset[str]:
    """The top-level names `model` knows: its fields, their aliases, and its refused fields."""
    names: set[str] = set(getattr(model, "REFUSED_FIELDS", {}))
    for name, info in model.model_fields.items():
        names.add(name)
        for alias in (info.alias, info.validation_alias):
            if isinstance(alias, str):
                names.add(alias)
    return frozenset(names)


@functools.cache
def _nested_models(model: type[BaseModel]) -> dict[str, tuple[type[BaseModel] | None, type[BaseModel] | None]]:
    """Per field name (and alias) of `model`: the model a JSON object in it is read as, and
    the model of the objects of a JSON array in it (`stream_options`: StreamOptions, None;
    `messages`: None, ChatMessage). Fields without models are left out."""
    out: dict[str, tuple[type[BaseModel] | None, type[BaseModel] | None]] = {}
    for name, info in model.model_fields.items():
        direct: list[type[BaseModel]] = []
        in_list: list[type[BaseModel]] = []
        stack: list[tuple[Any, bool]] = [(info.annotation, False)]
        while stack:
            annotation, listed = stack.pop()
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                (in_list if listed else direct).append(annotation)
                continue
            origin = typing.get_origin(annotation)
            for arg in typing.get_args(annotation):
                stack.append((arg, listed or origin is list))
        entry = (direct[0] if len(direct) == 1 else None, in_list[0] if len(in_list) == 1 else None)
        if entry != (None, None):
            for key in (name, info.alias):
                if isinstance(key, str):
                    out[key] = entry
    return out


def unknown_fields(model: type[BaseModel], body: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The keys of a request body that are neither fields of `model` nor refused by it, and
    those of the objects nested in its fields (`stream_options.x`, `messages[].x`). Objects
    whose model refuses unknown keys (`extra="forbid"`) are not walked: they get a 400."""
    known = known_fields(model)
    out = [prefix + key for key in body if key not in known]
    for key, (direct, listed) in _nested_models(model).items():
        value = body.get(key)
        if isinstance(value, dict) and direct is not None and direct.model_config.get("extra") != "forbid":
            out += unknown_fields(direct, value, f"{prefix}{key}.")
        elif isinstance(value, list) and listed is not None and listed.model_config.get("extra") != "forbid":
            seen: set[str] = set()
            for item in value:
                if isinstance(item, dict):
                    seen.update(unknown_fields(listed, item, f"{prefix}{key}[]."))
            out += sorted(seen)
    return out


def log_unknown_fields(model: type[BaseModel], body: Mapping[str, Any]) -> None:
    """Warn once per (request model, field name) per process about fields nobody reads.

    They are ignored (vLLM compatibility: clients send extensions of other servers), but
    an operator should learn that a client expects something this server does not do.
    Keys nested in known objects are logged by their path (`stream_options.x`, `messages[].x`).
    """
    for name in unknown_fields(model, body):
        key = (model.__name__, name[:_MAX_LOGGED_NAME_LEN])
        with _logged_unknown_lock:
            if key in _logged_unknown or len(_logged_unknown) > MAX_UNKNOWN_FIELDS_LOGGED:
                continue
            _logged_unknown.add(key)
            full = len(_logged_unknown) > MAX_UNKNOWN_FIELDS_LOGGED
        if full:
            logger.warning("%d unknown request field names logged; not logging any more", MAX_UNKNOWN_FIELDS_LOGGED)
        else:
            logger.warning("ignoring unknown request field %r (not an OpenAI or vLLM field)", key[1])


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


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0
    """Completion tokens of a reasoning model's thinking, its tags included (server/reasoning.py)."""


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = Field(None, exclude_if=lambda v: v is None)
    """Only for a model with a reasoning parser."""


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
    # vLLM's (server/protocol_vllm.py): prompt_logprobs is null unless asked, as vLLM sends it;
    # the token ids only with return_token_ids.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)


class CompletionStreamChoice(CompletionChoice):
    """A streamed choice: prompt logprobs are not streamed (vLLM refuses them with stream)."""

    prompt_logprobs: SkipJsonSchema[None] = Field(None, exclude=True)


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    """Always null, as vLLM sends it: no fingerprint of the backend's configuration is kept
    (GET /version names the build)."""
    usage: UsageInfo


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    system_fingerprint: str | None = None
    """Null: see `CompletionResponse.system_fingerprint`."""
    usage: UsageInfo | None = Field(None, exclude_if=lambda v: v is None)


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(_Response):
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's shape: a string, not an object)."""


class ChatResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ChatResponseToolCall] | None = Field(None, exclude_if=lambda v: not v)
    """The calls the model made (finish_reason "tool_calls"); left out of the JSON when none."""
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)
    """A reasoning model's thinking (server/reasoning.py); left out when the model did not think."""
    reasoning: str | None = Field(None, exclude_if=lambda v: v is None)
    """The same text under vLLM's newer name."""


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)
    """vLLM's `return_token_ids`: the reply's token ids."""


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    """Null: see `CompletionResponse.system_fingerprint`."""
    usage: UsageInfo
    # vLLM's, on the response (one prompt): null unless asked, as vLLM sends it.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)


class ChatStreamChoice(_Response):
    index: int
    delta: dict[str, Any]
    """`{"role": "assistant", "content": ""}` first, then `{"content": ...}` or `{"tool_calls":
    [{"index", "id"?, "type"?, "function": {"name"?, "arguments"}}]}`, `{}` last."""
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)
    """vLLM's `return_token_ids`: the output tokens this chunk adds."""


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    system_fingerprint: str | None = None
    """Null: see `CompletionResponse.system_fingerprint`."""
    usage: UsageInfo | None = Field(None, exclude_if=lambda v: v is None)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)
    """vLLM's `return_token_ids`: in the stream's first chunk."""


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagoda"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (server/serving_lora.py); None for the base itself."""
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


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
    as_token_ids: bool = False,
) -> tuple[CompletionLogprobs, int]:
    """Legacy completions logprobs for a run of tokens; returns them and the next text offset.

    Each dict holds the sampled token first, then the top-k alternatives (vLLM's shape:
    top_logprobs has k entries, k + 1 when the sampled token is not among them).
    `hidden_ids`: tokens shown as "" (the special tokens, when the text skips them).
    `into`: append to these (the echoed prompt's entries) instead of starting empty.
    `as_token_ids`: tokens spelled `token_id:N` (vLLM's `return_tokens_as_token_ids`); the
    offsets still count the text's characters.
    """
    out = into if into is not None else CompletionLogprobs()
    for entry in token_logprobs:
        sampled_id, sampled = next(iter(entry.items()))
        token = _token_text(sampled_id, sampled, hidden_ids)
        out.tokens.append(token_id_string(sampled_id) if as_token_ids else token)
        out.token_logprobs.append(_finite(sampled.logprob))
        out.top_logprobs.append({
            (token_id_string(t) if as_token_ids else _token_text(t, lp, hidden_ids)): _finite(lp.logprob)
            for t, lp in entry.items()
        })
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out, text_offset


def echo_logprobs(
    first_token: str, prompt_logprobs: list[dict[int, Logprob] | None], first_token_id: int | None = None,
    as_token_ids: bool = False,
) -> tuple[CompletionLogprobs, int]:
    """The echoed prompt's entries in the legacy format, and the text offset after them.

    Nothing predicts the first token, so its logprob and top_logprobs are null (as OpenAI);
    each later entry holds the prompt token first, then the top-k alternatives. The prompt
    is echoed verbatim, so its special tokens keep their text. With `as_token_ids` the first
    token reads `token_id:{first_token_id}`.
    """
    shown = token_id_string(first_token_id) if as_token_ids and first_token_id is not None else first_token
    out = CompletionLogprobs(text_offset=[0], token_logprobs=[None], tokens=[shown], top_logprobs=[None])
    return completion_logprobs(prompt_logprobs[1:], len(first_token), into=out,  # type: ignore[arg-type]
                               as_token_ids=as_token_ids)


def chat_logprobs(
    token_logprobs: list[dict[int, Logprob]], top_k: int, hidden_ids: frozenset[int] = frozenset(),
    as_token_ids: bool = False,
) -> ChatChoiceLogprobs:
    """Chat logprobs: each token with its `top_k` best alternatives; `as_token_ids`: tokens
    (and their bytes) spelled `token_id:N` (vLLM's `return_tokens_as_token_ids`)."""
    content = []
    for entry in token_logprobs:
        sampled_id, sampled = next(iter(entry.items()))
        # The k best by rank: the sampled token is in them only if its rank is <= k.
        top = sorted(entry.items(), key=lambda item: item[1].rank)[:top_k] if top_k else []
        token = token_id_string(sampled_id) if as_token_ids else _token_text(sampled_id, sampled, hidden_ids)
        alternatives = []
        for t, lp in top:
            text = token_id_string(t) if as_token_ids else _token_text(t, lp, hidden_ids)
            alternatives.append(ChatTopLogprob(token=text, logprob=_finite(lp.logprob), bytes=list(text.encode("utf-8"))))
        content.append(
            ChatTokenLogprob(
                token=token, logprob=_finite(sampled.logprob), bytes=list(token.encode("utf-8")), top_logprobs=alternatives
            )
        )
    return ChatChoiceLogprobs(content=content)

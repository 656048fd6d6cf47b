"""What a request asks its output to match: a JSON schema, any JSON object, a regex, one of
a list of strings, or a grammar (Lark, or GBNF converted to Lark).

The server builds a `StructuredOutputSpec` from `response_format`, `structured_outputs`
(vLLM's field) or the older `guided_*` aliases, and from `tools` / `tool_choice` (a Lark
grammar with inline `%json` schemas); the engine compiles it once per distinct spec
(`cache_key`) and constrains each sample's tokens to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_BYTES = 256 * 1024
"""Longest Lark/GBNF grammar taken: compiling recurses over nested rules (manager.py)."""


class GrammarError(ValueError):
    """The spec is not a valid schema / regex / grammar, or compiling it failed or ran too
    long. `param` is the request field to blame (set by whoever built the spec)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    kind: Kind
    value: str
    """json: the schema as JSON text; json_object: ""; regex: the pattern; choice: a JSON
    list of the strings; grammar: Lark (or GBNF) text."""
    param: str | None = None
    """The request field the spec came from, named in errors (e.g. "response_format")."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown structured output kind {self.kind!r}; expected one of {KINDS}", self.param)

    @property
    def cache_key(self) -> tuple[str, str]:
        return (self.kind, self.value)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str, param: str | None = None) -> "StructuredOutputSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}", param) from e
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object (or a boolean)", param)
        # Compact text as the cache key; key order is kept, since the output follows the
        # schema's property order (a tool call's "name" before its "arguments").
        return cls("json", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def json_object(cls, param: str | None = None) -> "StructuredOutputSpec":
        return cls("json_object", "", param)

    @classmethod
    def regex(cls, pattern: str, param: str | None = None) -> "StructuredOutputSpec":
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("a regex must be a non-empty string", param)
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: list[str], param: str | None = None) -> "StructuredOutputSpec":
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError("choice must be a non-empty list of strings", param)
        return cls("choice", json.dumps(choices), param)

    @classmethod
    def grammar(cls, text: str, param: str | None = None) -> "StructuredOutputSpec":
        if not isinstance(text, str) or not text.strip():
            raise GrammarError("a grammar must be a non-empty string", param)
        if len(text.encode("utf-8")) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"the grammar is longer than the limit of {MAX_GRAMMAR_BYTES} bytes", param)
        return cls("grammar", text, param)

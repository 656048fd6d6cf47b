"""The llguidance backend: JSON schema, regex, choice and Lark/GBNF grammars.

llguidance walks the tokenizer's token trie against a lexer + Earley parser; a mask costs
tens of microseconds per row, and a batch is filled in parallel on its own Rust threads
(the GIL is released). Limits on lexer fuel and grammar size (`LLParserLimits`) make a
pathological schema fail to compile instead of running for minutes.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import llguidance
import llguidance.gbnf_to_lark
import llguidance.torch
import torch

from engine.structured_output.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from engine.structured_output.spec import GrammarError, StructuredOutputSpec

logger = logging.getLogger("pagoda.engine")

# Compact, fixed JSON whitespace (", " and ": "): with free whitespace a small model can
# spend its whole token budget on newlines inside an object.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _byte_level_tokenizer_json(hf_tokenizer: Any) -> str:
    """The tokenizer as JSON for llguidance, with a plain ByteLevel decoder.

    llguidance reads a token's bytes through the decoder type; tokenizers converted from
    GGUF (the bundled model's) wrap ByteLevel in a Sequence with ByteFallback, which it
    does not recognise - it would then take "Ġ" for two bytes instead of a space.
    """
    backend = hf_tokenizer.backend_tokenizer
    spec = json.loads(backend.to_str())
    spec["padding"] = None
    spec["truncation"] = None
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if byte_level:
            spec["decoder"] = byte_level[0]
    return json.dumps(spec)


class _Matcher(GrammarMatcher):
    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def allows(self, token_id: int) -> bool:
        return self.matcher.validate_tokens([token_id]) == 1

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def num_allowed_prefix(self, token_ids: list[int]) -> int:
        return self.matcher.validate_tokens(token_ids)

    def copy(self) -> "_Matcher":
        return _Matcher(self.matcher.deep_copy())


class _Compiled(CompiledGrammar):
    def __init__(self, template: llguidance.LLMatcher) -> None:
        self.template = template  # never advanced; every request gets a copy

    def new_matcher(self) -> GrammarMatcher:
        return _Matcher(self.template.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor()
        self._limits = llguidance.LLParserLimits(verbose_errors=False)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        # Built on first use (~0.4 s): engines that never see a grammar do not pay for it.
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    _byte_level_tokenizer_json(self._hf_tokenizer),
                    n_vocab=self.vocab_size,
                    eos_token=self._eos_token_ids or None,
                )
            return self._tokenizer

    def grammar_text(self, spec: StructuredOutputSpec) -> str:
        """The spec in llguidance's serialized grammar form."""
        LL = llguidance.LLMatcher
        try:
            if spec.kind == "json":
                return LL.grammar_from_json_schema(spec.value, defaults=_JSON_OPTIONS)
            if spec.kind == "json_object":
                return LL.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
            if spec.kind == "regex":
                return LL.grammar_from_regex(spec.value)
            if spec.kind == "choice":
                choices = json.loads(spec.value)
                # Lark string literals take JSON escapes, so any string is spelled exactly.
                return LL.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
            text = spec.value
            if not llguidance.gbnf_to_lark.is_lark_syntax(text):
                text = llguidance.gbnf_to_lark.gbnf_to_lark(text)
            return LL.grammar_from_lark(text)
        except (ValueError, llguidance.gbnf_to_lark.GbnfToLarkError) as e:
            raise GrammarError(f"invalid {spec.kind}: {e}", spec.param) from e

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        grammar = self.grammar_text(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(f"invalid {_KIND_NAMES[spec.kind]}: {matcher.get_error()}", spec.param)
        self._probe(matcher.deep_copy(), spec)
        return _Compiled(matcher)

    def _probe(self, matcher: llguidance.LLMatcher, spec: StructuredOutputSpec) -> None:
        """Follow the grammar for its first PROBE_TOKENS tokens (each time the lowest-id
        token it allows, EOS last): a grammar that compiles but whose matcher fails on the
        way (a cyclic `$ref`, an `anyOf` of thousands of branches past the parser's row
        limit) is refused here, as a 400, instead of ending a request early with "stop"
        and output that breaks its schema."""
        bitmask = self.allocate_bitmask(1)
        for _ in range(PROBE_TOKENS):
            if matcher.is_stopped():
                return
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            if not matcher.is_error():
                token = self._first_allowed(bitmask[0].tolist())
                if token is None:
                    return  # only EOS (or nothing) from here: the output is complete
                matcher.consume_token(token)
            if matcher.is_error():
                reason = " ".join(matcher.get_error().replace("<non-verbose/>", "").split())
                raise GrammarError(
                    f"invalid {_KIND_NAMES[spec.kind]}: it compiles, but no output can follow it ({reason})", spec.param)

    def _first_allowed(self, words: list[int]) -> int | None:
        """The lowest token id other than EOS that a bitmask row (int32 words) allows."""
        for w, word in enumerate(words):
            word &= 0xFFFFFFFF
            while word:
                low = word & -word
                token = w * 32 + low.bit_length() - 1
                if token >= self.vocab_size:
                    return None
                if token not in self._eos_token_ids:
                    return token
                word ^= low
        return None

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return torch.full(llguidance.torch.get_bitmask_shape(num_rows, self.vocab_size), -1, dtype=torch.int32)

    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        pairs = [(m.matcher, i) for i, m in enumerate(matchers)]  # type: ignore[attr-defined]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, pairs, bitmask)


PROBE_TOKENS = 8
"""Tokens a new grammar is followed for at compile time (`LLGuidanceBackend._probe`)."""

_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}

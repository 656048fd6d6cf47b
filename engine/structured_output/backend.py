"""The interface between the engine and a grammar library.

A backend compiles a `StructuredOutputSpec` into a `CompiledGrammar` (shared by every
request with the same spec), each sample gets its own `GrammarMatcher` from it, and the
backend fills a batch of token bitmasks in one call. The scheduler and sampler see only
these three types and a bitmask tensor, so another library (e.g. xgrammar on a GPU) can
join by implementing them.

Bitmask layout (what llguidance and xgrammar use): int32 `[rows, ceil(vocab / 32)]`; bit
`t % 32` of word `t // 32` set means token `t` is allowed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.structured_output.spec import StructuredOutputSpec


class GrammarMatcher(ABC):
    """One sample's position in its grammar; advanced only by tokens it accepted."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the matcher
        is then in an error state and allows nothing more)."""

    @abstractmethod
    def allows(self, token_id: int) -> bool:
        """Whether the grammar allows `token_id` next, without computing the whole mask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no further token (except end-of-sequence)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def num_allowed_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar allows in a row from here,
        without advancing (speculative decoding trims its drafts to these)."""

    @abstractmethod
    def copy(self) -> "GrammarMatcher":
        """An independent matcher in the same state (a draft position's view)."""


class CompiledGrammar(ABC):
    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start; cheap (a copy of a compiled template)."""


class GrammarBackend(ABC):
    name: str

    @abstractmethod
    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """Compile `spec`; raises GrammarError for an invalid spec or one past the limits.
        Runs on a worker thread: implementations must be thread-safe."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """An int32 CPU tensor `[num_rows, ceil(vocab / 32)]`."""

    @abstractmethod
    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` := the tokens `matchers[i]` allows next (in parallel)."""

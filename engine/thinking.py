"""A reasoning model's thinking section: which output tokens are thinking, and its budget.

Reasoning models (Qwen3, DeepSeek-R1 and their distillations) write their thinking between
a start and an end tag (`<think>` ... `</think>`) before the answer. A request that carries
a `ThinkingSpec` has its output split here, on token ids, as it is generated:

- the thinking tokens go to a detokenizer of their own (`CompletionOutput.reasoning_text`),
  the tags to neither part, and only the answer's tokens to the request's detokenizer, so
  stop strings, `text` and everything parsed from it (tool calls) see the answer alone;
- the request's grammar (structured outputs, tool calls) starts with the first answer
  token: the thinking is free text;
- with a budget, once that many thinking tokens were generated the engine forces the end
  tag, token by token, and the answer begins (`max_tokens` still bounds the whole).

The tags are token id sequences: one special or added token each in the models above, or
the tag text's tokens where a tokenizer has no such token (then only that spelling of the
tag is recognised). Which tags, and whether the prompt already opened the thinking, is the
server's business (server/reasoning.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True, slots=True)
class ThinkingSpec:
    end_token_ids: tuple[int, ...]
    """The end tag's tokens: the first answer token is the one after them."""
    start_token_ids: tuple[int, ...] = ()
    """The start tag, when the output may begin with it (it is then neither thinking nor
    answer). Empty: the prompt opened the thinking."""
    start_required: bool = False
    """The model opens the thinking itself: an output that does not begin with the start tag
    is all answer (Qwen3). False: the thinking is open from the first output token, the
    start tag optional (DeepSeek-R1)."""
    budget: int | None = None
    """Most thinking tokens (tags not counted) before the end tag is forced; None: no limit."""

    def __post_init__(self) -> None:
        if not self.end_token_ids:
            raise ValueError("a thinking section needs an end tag")
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"the thinking budget must be >= 0, got {self.budget}")


class Part(enum.Enum):
    """What one output token is."""

    TAG = enum.auto()
    THINKING = enum.auto()
    ANSWER = enum.auto()


class ThinkingState:
    """Where one output is in its thinking; `advance` classifies each token as it comes.

    Tokens that could be the start of the end tag are held back (`held`) until the tag
    completes (they were the tag) or breaks (they were thinking)."""

    __slots__ = ("spec", "answering", "num_start_matched", "held", "num_thinking_tokens", "num_tokens")

    def __init__(self, spec: ThinkingSpec) -> None:
        self.spec = spec
        self.answering = False
        """The thinking ended (or never began): every later token is answer."""
        self.num_start_matched: int | None = 0 if spec.start_token_ids else None
        """Tokens of the start tag seen so far; None once it is no longer expected."""
        self.held: list[int] = []
        self.num_thinking_tokens = 0
        """Thinking tokens so far, held ones not counted."""
        self.num_tokens = 0
        """Output tokens so far; once answering, the tokens before the answer."""

    @property
    def thinking(self) -> bool:
        """The next token is thinking (or, before the start tag, may be)."""
        return not self.answering

    def copy(self) -> "ThinkingState":
        other = ThinkingState(self.spec)
        other.answering, other.num_start_matched = self.answering, self.num_start_matched
        other.held, other.num_thinking_tokens, other.num_tokens = list(self.held), self.num_thinking_tokens, self.num_tokens
        return other

    def forced_token(self) -> int | None:
        """The end tag's next token once the budget is spent (None: the model chooses)."""
        budget = self.spec.budget
        if self.answering or budget is None or (self.num_start_matched is not None and self.spec.start_required):
            return None
        if self.num_thinking_tokens >= budget:
            return self.spec.end_token_ids[len(self.held)]
        return None

    def advance(self, token: int) -> tuple[Part, list[int]]:
        """Take the next output token: what it is, and the thinking tokens it releases
        (held tokens that turned out not to be the end tag, then itself if it is thinking)."""
        if self.answering:
            return Part.ANSWER, []
        self.num_tokens += 1
        start = self.spec.start_token_ids
        if self.num_start_matched is not None:
            if token == start[self.num_start_matched]:
                self.num_start_matched += 1
                if self.num_start_matched == len(start):
                    self.num_start_matched = None
                return Part.TAG, []
            if self.num_start_matched == 0 and self.spec.start_required:  # the model answers without thinking
                self.answering = True
                self.num_tokens -= 1
                return Part.ANSWER, []
            # A partial start tag that broke off: those tokens were the answer's. Rare enough
            # (the tag is one token in every known model) to count as thinking instead.
            self.num_start_matched = None
        end = self.spec.end_token_ids
        if token == end[len(self.held)]:
            self.held.append(token)
            if len(self.held) == len(end):
                self.held = []
                self.answering = True
            return Part.TAG, []
        released = self.held
        self.held = []
        if token == end[0]:  # a broken match that restarts at this token
            self.held = [token]
            self.num_thinking_tokens += len(released)
            return Part.TAG, released
        self.num_thinking_tokens += len(released) + 1
        return Part.THINKING, released + [token]


class Thinking:
    """One request's thinking: its state and the detokenizer of its thinking text."""

    __slots__ = ("state", "detokenizer")

    def __init__(self, spec: ThinkingSpec, detokenizer: "IncrementalDetokenizer") -> None:
        self.state = ThinkingState(spec)
        self.detokenizer = detokenizer

    def advance(self, token: int) -> bool:
        """Take the next output token; True when it is answer (the caller's to detokenize)."""
        part, released = self.state.advance(token)
        if released:
            self.detokenizer.update(released)
        return part is Part.ANSWER

    def finish(self) -> None:
        """The output ended: a partial end tag still held back was thinking after all."""
        if self.state.held:
            self.detokenizer.update(self.state.held)
            self.state.held = []

    @property
    def num_reasoning_tokens(self) -> int:
        """Output tokens before the answer: thinking and tags."""
        return self.state.num_tokens

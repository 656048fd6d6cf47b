"""Prompt-lookup (n-gram) speculative decoding: proposals, and which of them the model accepts.

At one stream, decode is memory-bound: a step re-reads every weight whatever the number of
tokens it computes, so checking k guessed tokens costs about as much as computing one.
For input-grounded work (rewriting, summarising, answering from a document, editing code)
the next tokens often already appear earlier in the request. Each step, a decoding request
(`propose_ngram`) looks for the latest earlier occurrence of its longest suffix n-gram
(between `prompt_lookup_min` and `prompt_lookup_max` tokens) in its prompt + output and
proposes the k tokens that followed it. The scheduler schedules 1 + k tokens for it (the
last real token and the drafts, KV slots included); the forward pass returns logits at each
of the 1 + k positions, and the sampler draws a token at each of them, position j seeing
the drafts before j as output (`DraftRow`).

Acceptance (`num_accepted`): the first j drafts are kept while the token drawn at position i
equals draft i; the token drawn at the first mismatch (or, when all k match, at position k:
the bonus token) is emitted too. With a greedy request that is "accept while the argmax
equals the proposal". With a sampled request the proposal is a point mass at draft x, and
"accept with probability p(x); on rejection draw from p with x removed, renormalised" is
exactly "draw y ~ p; accept if y == x, else emit y": P(y == x) = p(x), and y given y != x
is p without x, renormalised. So the output distribution equals non-speculative sampling
(tests/engine/test_spec_decode.py checks it with a chi-square test).

Rollback is bookkeeping only: `num_computed_tokens` counts the real token and the accepted
drafts (the rejected drafts' KV slots are overwritten by later steps), and the prefix
cache registers only blocks full of verified tokens (`Scheduler`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.request import Request


def propose_ngram(tokens: list[int] | np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram of `tokens` (n from `lookup_max` down to `lookup_min`); [] when none matches.

    vLLM's ngram proposer also matches the longest suffix; it takes the earliest occurrence.
    The latest is the likelier continuation when a passage is quoted more than once (the
    copy being written is the latest occurrence but one).
    """
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = arr[length - n:]
        # Candidate starts i < length - n (an occurrence other than the suffix itself) whose
        # first token matches; then the full n-gram is compared for those only.
        starts = np.flatnonzero(arr[: length - n] == suffix[0])
        for i in starts[::-1]:
            if np.array_equal(arr[i:i + n], suffix):
                follow = arr[i + n: i + n + k]
                if len(follow):
                    return follow.tolist()
                break  # the latest occurrence ends at the end: nothing follows it
    return []


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts the model kept: `sampled[i]` is the token drawn at position
    i (len(drafts) + 1 of them); the request then emits `sampled[:accepted + 1]`."""
    accepted = 0
    for draft, token in zip(drafts, sampled):
        if draft != token:
            break
        accepted += 1
    return accepted


class DraftRow:
    """Position j of a request's verification: the request as the sampler sees it with the
    first j drafts already output (penalties, min_tokens and the like see them), its own
    seeded generator and everything else the request's."""

    __slots__ = ("request", "output_token_ids")

    def __init__(self, request: "Request", drafts: list[int]) -> None:
        self.request = request
        self.output_token_ids = request.output_token_ids + drafts

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.request.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids + self.output_token_ids

    def __getattr__(self, name: str):
        return getattr(self.request, name)

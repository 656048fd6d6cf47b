"""Incremental detokenization of one request's output, with stop strings.

Each engine step appends a token or so per request; re-decoding the whole output every
step would cost O(output length) per token. Instead we keep a small window of token
strings and decode only that window (the prefix_offset/read_offset technique of vLLM's
``detokenize_incrementally``): the window's first ``read_offset`` tokens are context that
was already turned into text; the text they decode to is cut off the front of the decoded
window, and what is left is the new text.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded as context for the first output tokens, so that tokenizers which
# drop a leading space at the start of a decode (SentencePiece) emit it mid-sentence.
_NUM_PROMPT_CONTEXT_TOKENS = 5
# Spare prompt ids converted on top of the context, since skipped special tokens vanish.
_NUM_PROMPT_SPARE_IDS = 2

# What byte-level decoders produce for bytes that are not (yet) a whole UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, a few tokens at a time.

    ``update`` appends tokens and reports a stop string once one appears; ``output_text``
    is everything decoded so far; ``get_delta_text`` hands out the text a stream may show.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        # The ids a skipping decode leaves out, taken once per request: the tokenizer's
        # `convert_ids_to_tokens(..., skip_special_tokens=True)` rebuilds this set from the
        # special tokens' strings at every call, every step of every request.
        self._skipped_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        # An empty stop string would match before any text; the server rejects it, and
        # here it is simply never a stop.
        self._stop = [s for s in stop if s]
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop_str_in_output = include_stop_str_in_output

        context_ids = prompt_token_ids[-(_NUM_PROMPT_CONTEXT_TOKENS + _NUM_PROMPT_SPARE_IDS) :]
        context_tokens = self._convert_ids_to_tokens(context_ids)
        # Token strings from the decode window's start; the first `_read_offset` of them
        # are context whose text is already part of `_text` (or of the prompt).
        self._window_tokens: list[str] = context_tokens[-_NUM_PROMPT_CONTEXT_TOKENS:]
        self._read_offset = len(self._window_tokens)

        self._text = ""
        # `_text[:_num_final_chars]` never changes again, except by stop truncation; the
        # rest is the text of tokens that end inside a UTF-8 character, and is decoded
        # again (completed) once later tokens bring its missing bytes.
        self._num_final_chars = 0
        self._num_emitted_chars = 0
        self._stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """Full decoded text so far (after any stop truncation)."""
        return self._text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append newly generated token ids; return the stop string if one now appears.

        Once a stop string was returned, the text is final and later calls change nothing.
        """
        if self._stop_reason is not None:
            return None
        window_tokens = self._window_tokens + self._convert_ids_to_tokens(new_token_ids)
        context_text = self._convert_tokens_to_string(window_tokens[: self._read_offset])
        window_text = self._convert_tokens_to_string(window_tokens)
        new_text = window_text[len(context_text) :] if len(window_text) > len(context_text) else ""

        previous_final_chars = self._num_final_chars
        # Replaces the previous unfinished tail, which `new_text` decodes again in full.
        self._text = self._text[:previous_final_chars] + new_text
        if window_text.endswith(_REPLACEMENT_CHAR):
            # The last character may still be completed: keep its tokens in the window.
            self._window_tokens = window_tokens
        else:
            self._window_tokens = window_tokens[self._read_offset :]
            self._read_offset = len(self._window_tokens)
            self._num_final_chars = len(self._text)

        return self._find_stop(search_start=previous_final_chars - (self._max_stop_len - 1))

    def get_delta_text(self, finished: bool) -> str:
        """Text not handed out by earlier calls.

        While not finished, holds back a trailing incomplete UTF-8 character and the
        longest suffix that might still grow into a stop string. Once finished (or
        stopped), returns all that is left, so the deltas add up to ``output_text``.
        """
        text = self._text
        end = len(text)
        if not finished and self._stop_reason is None:
            while end > self._num_emitted_chars and text[end - 1] == _REPLACEMENT_CHAR:
                end -= 1
            # With the stop string included in the output, a prefix of one may be shown:
            # whether or not it completes, it stays part of the text.
            if not self._include_stop_str_in_output:
                end -= self._longest_stop_prefix_suffix(text, end)
        end = max(end, self._num_emitted_chars)
        delta = text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta

    def _find_stop(self, search_start: int) -> str | None:
        """Truncate at the earliest stop string found from `search_start` on, if any.

        The earliest start wins; of two starting at the same place, the shorter one,
        since generation reached its end first.
        """
        search_start = max(search_start, 0)
        best: tuple[int, int, str] | None = None
        for stop_str in self._stop:
            index = self._text.find(stop_str, search_start)
            if index == -1:
                continue
            candidate = (index, len(stop_str), stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        index, length, stop_str = best
        end = index + length if self._include_stop_str_in_output else index
        self._text = self._text[:end]
        self._num_final_chars = end
        self._stop_reason = stop_str
        return stop_str

    def _longest_stop_prefix_suffix(self, text: str, end: int) -> int:
        """Length of the longest suffix of `text[:end]` (past what was already emitted)
        that is a proper prefix of some stop string."""
        available = end - self._num_emitted_chars
        longest = 0
        for stop_str in self._stop:
            for length in range(min(len(stop_str) - 1, available), longest, -1):
                if text.startswith(stop_str[:length], end - length, end):
                    longest = length
                    break
        return longest

    def _convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """The ids' token strings, special tokens left out where the request skips them (as
        the tokenizer's own `skip_special_tokens=True` does, with the set taken once)."""
        skipped = self._skipped_ids
        if skipped:
            token_ids = [i for i in token_ids if i not in skipped]
        return self._tokenizer.convert_ids_to_tokens(token_ids)

    def _convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self._tokenizer.convert_tokens_to_string(tokens) if tokens else ""

"""vLLM's request extensions on completions and chat, and what they add to the responses.

- `prompt_logprobs`: the prompt tokens' logprobs in vLLM's shape (`PromptLogprob`): a list
  with null for the first token (nothing predicts it), then one `{token_id: {logprob, rank,
  decoded_token}}` dict per token, holding the prompt token and the `prompt_logprobs` best
  alternatives. On a completions choice, on the chat response (as vLLM places them); null
  when not asked. Not with `stream` (as vLLM: a 400).
- `return_token_ids`: the prompt's token ids (`prompt_token_ids`) and each choice's output
  token ids (`token_ids`); streamed, the prompt's in the first chunk (of each choice on
  completions, of the stream on chat) and each chunk's new output tokens.
- `return_tokens_as_token_ids` (default: `--return-tokens-as-token-ids`): logprob tokens
  spelled `token_id:N`, which survive JSON when a token's bytes are not valid UTF-8.
- `truncate_prompt_tokens`: keep the prompt's last N tokens (-1: the model's maximum length).
- `echo` on chat: the reply's content starts with the last message's content when the reply
  continues that message (`chat_echo_prefix`).
- `top_logprobs: -1` / `prompt_logprobs: -1`: the whole vocabulary, bounded like every logprobs
  count by `--max-logprobs` (`num_logprobs`).

The checks of `logit_bias` keys and `stop_token_ids` are here too: one 400 names every
offending key or id.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.outputs import Logprob
from server.errors import InvalidRequestError

if TYPE_CHECKING:
    from server.protocol import ChatCompletionRequest

# Logprobs JSON cannot carry -inf; vLLM reports impossible tokens as -9999.0 too.
_MIN_LOGPROB = -9999.0
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")
"""A logit_bias key: ASCII digits only (str.isdigit() takes "²", "٣", "１２"), and short
enough that int() is cheap and below any vocabulary's size is checkable (no vocab has 10^10)."""
_MAX_SHOWN_KEY = 24
"""Characters of an offending logit_bias key quoted in the error message."""


class VllmRequestFields(BaseModel):
    """The vLLM request fields completions and chat share (a base of `SamplingRequest`)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    prompt_logprobs: int | None = Field(None, ge=-1)
    """vLLM's: the prompt tokens' logprobs with this many alternatives each (-1: the whole
    vocabulary), in the response's `prompt_logprobs`."""
    return_token_ids: bool | None = None
    """vLLM's: `prompt_token_ids` and each choice's `token_ids` in the response."""
    return_tokens_as_token_ids: bool | None = None
    """vLLM's: logprob tokens as `token_id:N` strings; none: the server's --return-tokens-as-token-ids."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """vLLM's: keep only the prompt's last N tokens (-1: the model's maximum length)."""

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's maximum length) or at least 1, got 0")
        return value

    @model_validator(mode="after")
    def _no_prompt_logprobs_in_streams(self) -> "VllmRequestFields":
        # As vLLM: the chunks have no place for them.
        if self.prompt_logprobs is not None and getattr(self, "stream", False):
            raise InvalidRequestError("prompt_logprobs are not available with stream", param="prompt_logprobs")
        return self


class PromptLogprob(BaseModel):
    """One entry of a `prompt_logprobs` dict (vLLM's `Logprob`)."""

    model_config = ConfigDict(allow_inf_nan=True)

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


def top_entries(entry: Mapping[int, Logprob], k: int) -> dict[int, Logprob]:
    """`entry` (the scored token first, then the engine's alternatives) cut to the scored
    token and the `k` best: the engine computed the most any field of the request asked for."""
    items = iter(entry.items())
    first_id, first = next(items)
    out = {first_id: first}
    out.update((t, lp) for t, lp in items if lp.rank <= k)
    return out


def prompt_logprobs_out(entries: list[dict[int, Logprob] | None], k: int) -> PromptLogprobs:
    """The engine's prompt logprobs in vLLM's shape, `k` alternatives per token, -inf as -9999.0."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        out.append({
            t: PromptLogprob(logprob=max(lp.logprob, _MIN_LOGPROB), rank=lp.rank, decoded_token=lp.decoded_token)
            for t, lp in top_entries(entry, k).items()
        })
    return out


def token_id_string(token_id: int) -> str:
    """A logprob token as `return_tokens_as_token_ids` spells it."""
    return f"token_id:{token_id}"


def num_logprobs(value: int | None, param: str, vocab_size: int, max_logprobs: int) -> int | None:
    """A logprobs count as the engine takes it: -1 is the whole vocabulary; more than
    `max_logprobs` (the server's --max-logprobs; -1: no cap) is a 400 naming `param`."""
    if value is None:
        return None
    count = vocab_size if value == -1 else value
    if max_logprobs != -1 and count > max_logprobs:
        asked = f"{value} (the whole vocabulary: {vocab_size})" if value == -1 else str(value)
        raise InvalidRequestError(
            f"{param} asks for {asked} logprobs per token; this server returns at most {max_logprobs} "
            "(--max-logprobs)",
            param=param,
        )
    return count


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (-1: `max_model_len`); all of them when it is shorter."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len
    elif keep > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens ({keep}) is larger than this model's maximum context length ({max_model_len})",
            param="truncate_prompt_tokens",
        )
    return token_ids[-keep:]


def logit_bias_token_ids(logit_bias: Mapping[str, float], vocab_size: int) -> dict[int, float]:
    """`logit_bias` keyed by token id; a 400 naming every key that is not one (not ASCII
    digits, out of the vocabulary, or a second spelling of another key's id)."""
    out: dict[int, float] = {}
    spelled: dict[int, str] = {}
    bad: list[str] = []
    for key, value in logit_bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key) or int(key) >= vocab_size:
            bad.append(_shown(key))
            continue
        token_id = int(key)
        if token_id in spelled:
            bad.append(f"{_shown(key)} (the same token as {_shown(spelled[token_id])})")
            continue
        spelled[token_id] = key
        out[token_id] = value
    if bad:
        raise InvalidRequestError(
            f"logit_bias keys must be token ids (ASCII digits) in [0, {vocab_size}); "
            f"{'this one is' if len(bad) == 1 else f'these {len(bad)} are'} not: {', '.join(bad)}",
            param="logit_bias",
        )
    return out


def check_stop_token_ids(stop_token_ids: list[int] | None, vocab_size: int) -> None:
    """A 400 naming every stop token id outside the vocabulary."""
    bad = [str(t) for t in stop_token_ids or () if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"stop_token_ids must be in [0, {vocab_size}); out of range: {', '.join(bad)}", param="stop_token_ids"
        )


def _shown(key: str) -> str:
    return repr(key if len(key) <= _MAX_SHOWN_KEY else key[:_MAX_SHOWN_KEY] + "...")


def chat_echo_prefix(req: "ChatCompletionRequest") -> str:
    """What `echo` puts in front of a chat reply: the last message's text when the reply
    continues it, as vLLM decides: the reply's role is "assistant" after a generation prompt,
    else the last message's own role, and the last message must have that role."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    if req.add_generation_prompt and last.role != "assistant":
        return ""
    return last.text()

"""llama.cpp's server conventions on the OpenAI routes.

Implemented (`LlamaCppRequestFields`, a base of `SamplingRequest`):

- `n_predict`: llama.cpp's name for `max_tokens` (-1: no limit, run to the end of the
  context). Given beside `max_tokens` / `max_completion_tokens` with another value it is a
  400 naming `n_predict` (llama.cpp would take `n_predict` and drop the other silently).
- `json_schema` (a JSON schema object) and `grammar` (GBNF, or llguidance's Lark): output
  constraints, mapped onto the structured-output path like vLLM's `guided_json` /
  `guided_grammar` (server/protocol.py `structured_output_spec`).

llama.cpp's request fields that Pagoda does not implement are refused unless they hold
llama.cpp's default (its clients, e.g. its web UI, send every field with its value).
`REFUSED_LLAMACPP`: field -> (why, the values that pass), made `Refusal`s by server/protocol.py.

llama.cpp's server takes its own sampling fields beside OpenAI's on /completion and on
its OpenAI routes. Each of these would change the output (another sampler, a time limit,
another response shape), so a value other than the default is a 400 naming the field
rather than a silent no-op. The fields llama.cpp shares with OpenAI and vLLM
(`temperature`, `top_k`, `min_p`, `seed`, `logit_bias`, `ignore_eos`, ...) are the
shared ones; the full table of fields and what each does here: docs/REQUEST_FIELDS.md.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.errors import InvalidRequestError


def _default(*values: Any) -> tuple[Any, ...]:
    """null and llama.cpp's default, with a number's int and float spellings."""
    out: list[Any] = [None]
    for v in values:
        out.append(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out += [int(v), float(v)] if float(v).is_integer() else [float(v)]
    return tuple(out)


_SAMPLER = "a llama.cpp sampler this server does not implement"
_LLAMACPP = "a llama.cpp server option this server does not implement"

REFUSED_LLAMACPP: Mapping[str, tuple[str, tuple[Any, ...]]] = {
    "mirostat": (_SAMPLER, _default(0)),
    "mirostat_tau": (_SAMPLER, _default(5.0)),
    "mirostat_eta": (_SAMPLER, _default(0.1)),
    "typical_p": (_SAMPLER, _default(1.0)),
    "tfs_z": (_SAMPLER, _default(1.0)),
    "top_n_sigma": (_SAMPLER, _default(-1.0)),
    "dynatemp_range": (_SAMPLER, _default(0.0)),
    "dynatemp_exponent": (_SAMPLER, _default(1.0)),
    "xtc_probability": (_SAMPLER, _default(0.0)),
    "xtc_threshold": (_SAMPLER, _default(0.1)),
    "dry_multiplier": (_SAMPLER, _default(0.0)),
    "dry_base": (_SAMPLER, _default(1.75)),
    "dry_allowed_length": (_SAMPLER, _default(2)),
    "dry_penalty_last_n": (_SAMPLER, _default(-1)),
    "dry_sequence_breakers": (_SAMPLER, (None, ["\n", ":", '"', "*"])),
    "repeat_penalty": (f"{_SAMPLER} under this name: use repetition_penalty", _default(1.0)),
    "repeat_last_n": (f"{_SAMPLER}: repetition_penalty here looks at the whole sequence", _default(64)),
    "penalize_nl": (_SAMPLER, (None, False)),
    "min_keep": (_SAMPLER, _default(0)),
    "samplers": ("the order of the samplers is fixed here", (None,)),
    "n_probs": ("use logprobs (completions) or logprobs + top_logprobs (chat)", _default(0)),
    "post_sampling_probs": (_LLAMACPP, (None, False)),
    "n_keep": (f"{_LLAMACPP}: there is no context shift; a prompt that does not fit is a 400", _default(0)),
    "n_indent": (_LLAMACPP, _default(0)),
    "t_max_predict_ms": (f"{_LLAMACPP}; --request-timeout bounds a request's time", _default(0)),
    "return_tokens": (_LLAMACPP, (None, False)),
    "timings_per_token": (_LLAMACPP, (None, False)),
    "return_progress": (_LLAMACPP, (None, False)),
    "response_fields": (_LLAMACPP, (None, [])),
    "lora": ("LoRA adapters are not served", (None, [])),
    "image_data": ("this model takes text only", (None, [])),
    # Cannot change the output: the prefix cache is automatic and keyed by content (any
    # boolean is taken), and there are no slots to pick.
    "cache_prompt": ("cache_prompt takes true or false", (None, True, False)),
    "id_slot": ("id_slot takes -1 (this server has no slots to pick)", _default(-1)),
}


_OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens")


class LlamaCppRequestFields(BaseModel):
    """The llama.cpp request fields completions and chat implement (a base of `SamplingRequest`)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    n_predict: int | None = Field(None, ge=-1)
    """llama.cpp's `max_tokens`: the most tokens to generate; -1: no limit."""
    json_schema: dict[str, Any] | None = None
    """llama.cpp's: the output is JSON matching this schema."""
    grammar: str | None = None
    """llama.cpp's: the output follows this grammar (GBNF, or llguidance's Lark)."""

    @model_validator(mode="after")
    def _n_predict_is_max_tokens(self) -> "LlamaCppRequestFields":
        # After the subclass's own fields: it sets max_tokens, which each endpoint declares.
        if self.n_predict is None:
            return self
        limit = None if self.n_predict == -1 else self.n_predict
        for name in _OUTPUT_LIMITS:
            given = getattr(self, name, None)
            if given is not None and name in self.model_fields_set and given != limit:
                raise InvalidRequestError(
                    f"n_predict ({self.n_predict}) is llama.cpp's name for {name} ({given}); give one of them, "
                    "or both with the same value",
                    param="n_predict",
                )
        if limit == 0 and "messages" in type(self).model_fields:
            raise InvalidRequestError("n_predict must be -1 (no limit) or at least 1 on chat", param="n_predict")
        self.max_tokens = limit  # type: ignore[attr-defined]  # declared by both endpoints' models
        return self

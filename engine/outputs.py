"""What the engine hands back: one `RequestOutput` per request, per step or at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str


# One dict per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    """None while running; "stop", "length" or "abort" at the end."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it, None for EOS or length."""
    delta_text: str = ""
    """Text that became safe to show since the previous output of this request (held-back
    stop-string prefixes and partial UTF-8 excluded until resolved): what streams send."""
    reasoning_text: str | None = None
    """With SamplingParams.thinking: the thinking's text (tags excluded; `text` is then the
    answer alone). None without it."""
    delta_reasoning_text: str = ""
    """Thinking text new since the previous output, as `delta_text` is for the answer."""
    num_reasoning_tokens: int = 0
    """Output tokens before the answer (thinking and its tags)."""
    error: str | None = None
    """Set with finish_reason "abort" when the request was at fault: its grammar could not be
    followed (the token that broke it is left out of `token_ids` and `text`). AsyncEngine
    raises it as a GrammarError, so a server answers with an error, never a "successful"
    output that breaks its schema."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With SamplingParams.prompt_logprobs: None for the first prompt token, then one dict each."""

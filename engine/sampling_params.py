"""Per-request sampling and stopping parameters (the OpenAI/vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.lora import LoraRequest
    from engine.structured_output.spec import StructuredOutputSpec
    from engine.thinking import ThinkingSpec

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    """Number of samples returned for the prompt."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    """Per-request seed: same seed => same tokens, whatever else is in the batch."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    """None: up to the context length."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens are generated."""
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    """Logprob of every prompt token after the first (plus top-k alternatives): echo/perplexity."""
    """Number of top alternatives returned with each sampled token's logprob (0 = only the sampled one)."""
    skip_special_tokens: bool = True
    structured_output: "StructuredOutputSpec | None" = None
    """Constrain the output to a JSON schema, regex, choice or grammar; ends with "stop"
    once the grammar is complete (max_tokens still cuts it, with "length")."""
    thinking: "ThinkingSpec | None" = None
    """A reasoning model's thinking section (engine/thinking.py): its tokens are reported
    apart from the answer, the grammar starts after it, its budget is enforced."""
    use_beam_search: bool = False
    """Return the n best sequences of a beam search of width n instead of n samples
    (engine/beam_search.py); deterministic, so the sampling fields must keep their defaults."""
    length_penalty: float = 1.0
    """Beam search: a finished beam scores its log-probability / (its length ** length_penalty)."""
    lora_request: "LoraRequest | None" = None
    """The LoRA adapter the request runs with (engine/lora.py); None: the base model."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._check_beam_search()
        if self.is_greedy:
            # Greedy ignores the filters; normalising them keeps the sampler's fast path simple.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_beam_search(self) -> None:
        """Beam search ranks the model's own log-probabilities: a field that would change
        them, or pick among them at random, cannot apply and is refused (by name)."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise ValueError("length_penalty applies only to beam search (use_beam_search)")
            return
        beam = "with use_beam_search"
        if self.temperature not in (0.0, 1.0):
            raise ValueError(f"temperature must be 0 or 1 {beam} (beams are ranked by the model's own log-probabilities), "
                             f"got {self.temperature}")
        for name, default in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("presence_penalty", 0.0),
                              ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != default:
                raise ValueError(f"{name} cannot be used {beam}")
        if self.logit_bias:
            raise ValueError(f"logit_bias cannot be used {beam}")
        if self.stop:
            raise ValueError(f"stop strings cannot be used {beam} (stop_token_ids can)")
        if self.structured_output is not None:
            raise ValueError(f"structured_output cannot be used {beam}")
        if self.thinking is not None:
            raise ValueError(f"a reasoning model's thinking cannot be separated {beam}")
        if self.max_tokens == 0:
            raise ValueError(f"max_tokens must be at least 1 {beam}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

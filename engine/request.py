"""The state of one request (one sample) inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.beam_search import BeamSearch
    from engine.detokenizer import IncrementalDetokenizer
    from engine.outputs import SampleLogprobs
    from engine.structured_output import RequestGrammar
    from engine.thinking import Thinking


class RequestStatus(enum.IntEnum):
    # Ordered so that `status > PREEMPTED` means finished.
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int
    """Resolved cap on output tokens (sampling_params.max_tokens or what fits the context)."""
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # vLLM v1 style: there is no prefill/decode phase, only tokens not yet computed.
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    """Why the engine ended it with "abort" when the request itself is at fault (a grammar
    its output could not follow); None otherwise."""
    logprobs: "SampleLogprobs | None" = None
    prompt_logprobs: list | None = None
    """One entry per prompt token (None for the first); filled chunk by chunk during prefill."""
    detokenizer: "IncrementalDetokenizer | None" = None
    cache_salt: str | None = None
    """Extra prefix-cache key: requests with different salts never share cached blocks."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chain hashes of the request's full blocks (append-only, like its tokens)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache when the request was first scheduled."""
    fork_parent: "Request | None" = None
    """Sample j > 0 of an n > 1 request: shares sample 0's prompt blocks once computed."""
    grammar: "RequestGrammar | None" = None
    """The grammar its tokens must follow (SamplingParams.structured_output), compiled or compiling."""
    thinking: "Thinking | None" = None
    """Its thinking section (SamplingParams.thinking): state, budget and thinking text."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    tenant: str | None = None
    """Who the request is for (the server's API-key name); the waiting queue is fair between
    tenants (engine/fair_queue.py). None: untagged (the Python API, a server without keys)."""
    priority: int = 0
    """Lower is scheduled first (vLLM's convention); strict between priorities."""
    beam_search: "BeamSearch | None" = None
    """The beam search this request is a beam of, or stands for (engine/beam_search.py)."""

    def __post_init__(self) -> None:
        if self.sampling_params.logprobs is not None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    @property
    def cache_extra_keys(self) -> tuple:
        keys = () if self.cache_salt is None else (self.cache_salt,)
        lora = self.sampling_params.lora_request
        # KV computed under one adapter is not another's (nor the base's): its id keys the blocks.
        return keys if lora is None else (*keys, ("lora", lora.lora_id))

    @property
    def waiting_for_grammar(self) -> bool:
        return self.grammar is not None and not self.grammar.is_ready

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

"""What one engine step reports for metrics; the server turns it into Prometheus series."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency_s: float
    queue_time_s: float | None
    """Arrival to first scheduled; None if it never ran (aborted while waiting)."""
    tenant: str | None = None
    """The request's tenant (API-key name), for the per-tenant series; None: untagged."""
    time_to_first_token_s: float | None = None
    """Arrival to first token; None if it produced none."""


@dataclass(slots=True)
class StepStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of KV blocks in use, 0..1."""
    kv_cache_tail_waste_tokens: int
    """Allocated but unused slots in the last block of every running request."""
    num_scheduled_tokens: int
    num_prompt_tokens: int = 0
    """Prompt tokens of requests that produced their first token this step."""
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    kv_events_dropped: int = 0
    """KV-cache events dropped this step: the publisher's queue was full."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache this step."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached."""
    spec_num_drafts: int = 0
    """Speculative decoding: requests that verified drafts this step."""
    spec_num_draft_tokens: int = 0
    """Draft tokens verified this step."""
    spec_num_accepted_tokens: int = 0
    """Of those, the ones the model accepted."""
    spec_accepted_per_position: list[int] = field(default_factory=list)
    """One entry per accepted draft: its position (0 = the first draft)."""
    time_to_first_token_s: list[float] = field(default_factory=list)
    inter_token_latency_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    lora_adapters: tuple[list[str], list[str]] | None = None
    """With LoRA on: the adapter names of the running and of the waiting requests (after the step)."""

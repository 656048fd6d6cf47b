"""Which request fields a server accepts for fixed output lengths, found by asking it.

A benchmark compares servers on the same token counts, so by default every request asks
for exactly ``max_tokens`` tokens. Servers spell that differently or not at all:

- ``ignore_eos: true`` (vLLM, Pagoda);
- ``min_tokens = max_tokens`` (vLLM, llama-cpp-python's server in recent versions);
- ``generation_config: '{"eos_token_id": -1}'`` (``transformers serve``: a JSON
  GenerationConfig per request; EOS id -1 disables the stop);
- nothing: outputs end at EOS, and the report says the lengths vary.

Each candidate is tried with one short streamed request; the first one answered 200 wins.
Servers that reject unknown fields (transformers serve answers 422 for ``ignore_eos``) fall
through to the next; ``stream_options`` is dropped first if the server rejects it. A server
that accepts a field but ignores it is caught afterwards: the summary counts the outputs
shorter than ``max_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import httpx

from loadtest.client import RequestParams, send_request
from loadtest.datasets import BenchRequest


@dataclass(frozen=True, slots=True)
class FixedLengthMode:
    name: str
    fields: Callable[[int], dict] | None
    note: str


MODES = (
    FixedLengthMode("ignore_eos", lambda n: {"ignore_eos": True}, "ignore_eos"),
    FixedLengthMode("min_tokens", lambda n: {"min_tokens": n}, "min_tokens = max_tokens (no ignore_eos)"),
    FixedLengthMode(
        "generation_config",
        lambda n: {"generation_config": json.dumps({"eos_token_id": -1, "max_new_tokens": n})},
        'generation_config {"eos_token_id": -1} (no ignore_eos)',
    ),
)
NO_FIXED_LENGTH = FixedLengthMode("none", None, "no fixed length: outputs stop at EOS")


@dataclass(slots=True)
class Negotiated:
    mode: FixedLengthMode
    include_usage: bool
    rejected: list[str]  # "field: HTTP 422 message" for each candidate the server refused

    @property
    def note(self) -> str:
        parts = [self.mode.note]
        if not self.include_usage:
            parts.append("no stream_options (tokens counted from chunks)")
        return "; ".join(parts)


async def negotiate(client: httpx.AsyncClient, params: RequestParams, sample: BenchRequest, want_fixed_length: bool) -> Negotiated:
    """Probe the server with ``sample`` (cut to 4 tokens) and return what it accepts."""
    probe = BenchRequest(min(sample.max_tokens, 4), prompt=sample.prompt, messages=sample.messages)
    rejected: list[str] = []

    async def accepted(mode: FixedLengthMode, include_usage: bool) -> bool:
        trial = RequestParams(
            model=params.model, temperature=params.temperature, include_usage=include_usage,
            fixed_length_fields=mode.fields, request_timeout_s=params.request_timeout_s,
        )
        result = await send_request(client, probe, trial, 0.0)
        if result.ok:
            return True
        if result.error_kind and result.error_kind.startswith("http_4"):
            rejected.append(f"{mode.name}{'' if include_usage else ' (no stream_options)'}: "
                            f"{result.error_kind} {result.error}")
            return False
        # Not a refusal of the fields: the server itself is failing; say so plainly.
        raise ConnectionError(f"probe request failed: {result.error_kind}: {result.error}")

    include_usage = params.include_usage
    if not await accepted(NO_FIXED_LENGTH, include_usage):
        if not (include_usage and await accepted(NO_FIXED_LENGTH, False)):
            raise ConnectionError(f"the server refuses a plain streamed request: {rejected[-1]}")
        include_usage = False
    if want_fixed_length:
        for mode in MODES:
            if await accepted(mode, include_usage):
                return Negotiated(mode, include_usage, rejected)
    return Negotiated(NO_FIXED_LENGTH, include_usage, rejected)

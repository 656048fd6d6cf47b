"""Per-key rate limits, as the OpenAI API answers them.

Each named key (server/tenants.py) may have a `requests_per_minute`, a `tokens_per_minute`
and a `max_concurrent_requests`. The per-minute limits are token buckets holding one
minute's allowance, refilled continuously (limit / 60 per second), so a key may burst up to
its limit and then goes at the limit's pace:

- a request takes one unit of the request bucket when it is admitted;
- its prompt tokens are taken from the token bucket once tokenized (a request is refused
  while the bucket holds fewer than its prompt's tokens), and its completion tokens as the
  engine produces them. Those are never refused: the bucket may go below zero (a debt
  that holds back the key's next requests), so a stream is never cut off by its own tokens;
- concurrency counts samples (a request's prompts x n, the rows the engine runs) from
  admission to the end of their response: one request of 64 prompts x n=16 holds 1,024
  places of a key's max_concurrent_requests, as 1,024 one-sample requests would.

A refusal is `RateLimitExceeded` (the server answers 429 `rate_limit_exceeded` with
`Retry-After` / `retry-after-ms`, which the OpenAI SDK waits for before it retries).
`headers()` gives OpenAI's `x-ratelimit-*` headers, sent with every response to the key.
Everything runs on the event loop: no locks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

CONCURRENCY_RETRY_AFTER_S = 1.0
"""Retry-After of a refusal for max_concurrent_requests: when a slot frees is unknown."""


class RateLimitExceeded(Exception):
    """A request over one of its key's limits; `kind` is "requests", "tokens" or
    "concurrency", `retry_after_s` when it would pass."""

    def __init__(self, kind: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_s = retry_after_s


def format_duration(seconds: float) -> str:
    """OpenAI's (Go's) duration format of the reset headers: "20ms", "1s", "1.5s", "6m0s"."""
    seconds = max(seconds, 0.0)
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    millis = math.ceil(seconds * 1000)
    minutes, millis = divmod(millis, 60_000)
    hours, minutes = divmod(minutes, 60)
    secs = f"{millis / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


class TokenBucket:
    """`per_minute` units, refilled at per_minute / 60 per second, starting full."""

    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self._clock = clock
        self.level = self.capacity
        self._time = clock()

    def _refill(self) -> float:
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._time) * self.rate)
        self._time = now
        return self.level

    def wait_s(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (0: it does now)."""
        level = self._refill()
        return 0.0 if level >= amount else (amount - level) / self.rate

    def take(self, amount: float) -> None:
        """Take `amount`, into debt if need be."""
        self._refill()
        self.level -= amount

    def remaining(self) -> int:
        return max(0, math.floor(self._refill()))

    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        return (self.capacity - self._refill()) / self.rate

    def resize(self, per_minute: int) -> None:
        """A new limit (a reloaded keys file): the level carries over, capped at the new limit."""
        self._refill()
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = min(self.level, self.capacity)


@dataclass(frozen=True, slots=True)
class Limits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute,
                                            self.max_concurrent_requests))


class KeyLimiter:
    """One key's buckets and concurrency count (kept across reloads while its name stays)."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.limits = limits
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.in_flight = 0
        self.update(limits)

    def update(self, limits: Limits) -> None:
        self.limits = limits
        self.requests = self._bucket(self.requests, limits.requests_per_minute)
        self.tokens = self._bucket(self.tokens, limits.tokens_per_minute)

    def _bucket(self, bucket: TokenBucket | None, per_minute: int | None) -> TokenBucket | None:
        if per_minute is None:
            return None
        if bucket is None:
            return TokenBucket(per_minute, self._clock)
        bucket.resize(per_minute)
        return bucket

    def admit_request(self, num_samples: int = 1) -> None:
        """Take a request unit and `num_samples` concurrency places, or raise RateLimitExceeded
        (ValueError when the request alone has more samples than the key's limit: no wait
        would let it through). A key in token debt is refused here too, before any tokenizing
        (every prompt has a token)."""
        limit = self.limits.max_concurrent_requests
        if limit is not None and num_samples > limit:
            raise ValueError(f"the request has {num_samples} samples (prompts x n), more than this API key's "
                             f"max_concurrent_requests ({limit})")
        if limit is not None and self.in_flight + num_samples > limit:
            raise RateLimitExceeded(
                "concurrency", f"this API key has {self.in_flight} samples in flight and asks for {num_samples} more, "
                f"past its limit (max_concurrent_requests {limit}); retry when one finishes", CONCURRENCY_RETRY_AFTER_S)
        if self.requests is not None and (wait := self.requests.wait_s(1)) > 0:
            raise RateLimitExceeded(
                "requests", f"rate limit reached for requests per minute: limit {self.limits.requests_per_minute}; "
                f"retry in {format_duration(wait)}", wait)
        if self.tokens is not None and (wait := self.tokens.wait_s(1)) > 0:
            raise RateLimitExceeded(
                "tokens", f"rate limit reached for tokens per minute: limit {self.limits.tokens_per_minute}, used "
                f"{self.limits.tokens_per_minute - math.floor(self.tokens.level)}; retry in {format_duration(wait)}",
                wait)
        if self.requests is not None:
            self.requests.take(1)
        self.in_flight += num_samples

    def refund_request(self) -> None:
        """Give back a request unit (the request was refused later, for its tokens)."""
        if self.requests is not None:
            self.requests.take(-1)

    def admit_tokens(self, num_tokens: int) -> None:
        """Take a request's prompt tokens, or raise RateLimitExceeded (ValueError when they
        exceed the whole per-minute limit: no wait would let them through)."""
        if self.tokens is None:
            return
        limit = self.limits.tokens_per_minute
        if num_tokens > limit:
            raise ValueError(f"the prompt has {num_tokens} tokens, more than this API key's tokens_per_minute "
                             f"({limit})")
        if (wait := self.tokens.wait_s(num_tokens)) > 0:
            raise RateLimitExceeded(
                "tokens", f"rate limit reached for tokens per minute: limit {limit}, remaining "
                f"{self.tokens.remaining()}, requested {num_tokens}; retry in {format_duration(wait)}", wait)
        self.tokens.take(num_tokens)

    def charge_tokens(self, num_tokens: int) -> None:
        """Completion tokens as they are produced: never refused (see the module docstring)."""
        if self.tokens is not None and num_tokens > 0:
            self.tokens.take(num_tokens)

    def release(self, num_samples: int = 1) -> None:
        """A request admitted by admit_request ended (its concurrency places free)."""
        self.in_flight = max(0, self.in_flight - num_samples)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers for the limits this key has."""
        out = []
        for kind, bucket, limit in (("requests", self.requests, self.limits.requests_per_minute),
                                    ("tokens", self.tokens, self.limits.tokens_per_minute)):
            if bucket is None:
                continue
            out += [
                (f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()),
                (f"x-ratelimit-remaining-{kind}".encode(), str(bucket.remaining()).encode()),
                (f"x-ratelimit-reset-{kind}".encode(), format_duration(bucket.reset_s()).encode()),
            ]
        return out


def retry_after_headers(seconds: float) -> dict[str, str]:
    """`Retry-After` in whole seconds (RFC 9110; at least 1) and `retry-after-ms`, the
    precise wait, which the OpenAI SDK prefers."""
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}

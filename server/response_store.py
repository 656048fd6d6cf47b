"""The bounded in-memory store behind `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}`.

Each stored response keeps the response object a client reads back and the conversation
that led to it (the input items of the whole chain, then its own output items), so a
continuation renders the same prompt prefix without walking a chain whose earlier links
may already be gone - and so reuses the prefix cache.

Bounds: at most `max_entries` responses holding at most `max_bytes` together (as JSON; the
least recently used ones go first) and each one lives `ttl_s` seconds after its last use. A response belongs to an owner (the API key
that created it, or nobody when the server has no key); a lookup by another owner is the
same 404 as an unknown id, so ids of other keys cannot be probed. Everything runs on the
event loop: no locks.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from server.errors import NotFoundError

ANONYMOUS = "anonymous"
"""The owner of every response on a server without an API key."""


def key_owner(api_key: str | None) -> str:
    """The owner id of requests authenticated by `api_key` (a digest, so the key itself is
    never kept next to the data). Several named keys would each get their own id."""
    if not api_key:
        return ANONYMOUS
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:32]


@dataclass(slots=True)
class StoredResponse:
    id: str
    owner: str
    response: dict[str, Any]
    """The response object as `GET /v1/responses/{id}` returns it."""
    conversation: list[dict[str, Any]]
    """The input items of the chain and this response's output items, normalized
    (server/protocol_responses.py), which a continuation puts before its own input."""
    num_bytes: int = 0
    """The entry's size as JSON: what the store's memory gauge adds up."""
    expires_at: float = 0.0


class ResponseStore:
    """An LRU of `StoredResponse` bounded by count, by bytes and by time since last use."""

    def __init__(
        self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic,
        max_bytes: int | None = None,
    ) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        """Store `entry` (most recently used), evicting expired entries and then the least
        recently used ones beyond `max_entries` or `max_bytes`. With `max_entries` 0 nothing
        is kept, nor is an entry larger than `max_bytes` by itself."""
        self._expire()
        entry.num_bytes = len(json.dumps([entry.response, entry.conversation]))
        entry.expires_at = self._clock() + self.ttl_s
        self._drop(entry.id)
        if self.max_bytes is not None and entry.num_bytes > self.max_bytes:
            return  # it could only be kept by evicting everything else, and then not
        self._entries[entry.id] = entry
        self.num_bytes += entry.num_bytes
        while len(self._entries) > self.max_entries or (self.max_bytes is not None and self.num_bytes > self.max_bytes):
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.num_evicted += 1

    def get(self, response_id: str, owner: str, param: str | None = None) -> StoredResponse:
        """The entry, refreshed as most recently used; 404 (naming `param`) when it is
        unknown, expired, evicted, deleted or another owner's."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            raise NotFoundError(
                f"no response with id {response_id!r} is stored here (never stored with store=true, deleted, "
                "expired or evicted)",
                param=param,
            )
        self._entries.move_to_end(response_id)
        entry.expires_at = self._clock() + self.ttl_s
        return entry

    def delete(self, response_id: str, owner: str) -> None:
        """Forget the entry; 404 as `get` when there is none to forget."""
        self.get(response_id, owner)
        self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes

    def _expire(self) -> None:
        # Expiry times grow along the LRU order (every use moves an entry to the end with a
        # fresh time), so the expired entries are a prefix of it.
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires_at > now:
                break
            self._drop(oldest.id)
            self.num_evicted += 1

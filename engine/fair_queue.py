"""The scheduler's waiting queue: fair between tenants, strict by priority.

A `Request` may carry a `tenant` (the server puts the API key's name there) and a
`priority` (lower is served first, as vLLM's `--scheduling-policy priority`). The next
request to admit is chosen by:

1. priority: the lowest value among waiting requests, always (a strict order: a flood of
   urgent requests starves less urgent ones, by design);
2. then the tenant with the least recent use of the engine: the tokens the scheduler gave
   its requests (prompt chunks and decodes alike), decayed with a half-life of
   `USAGE_HALF_LIFE_S`, so that a tenant that has been idle is served before one that has
   kept the engine busy, and a burst long ago is forgotten (least attained service, with
   a memory);
3. within one tenant and priority, arrival order (a preempted or put-back request goes to
   the front of its own tenant's line, as in the plain deque).

`Scheduler` uses it exactly like the `deque` it replaces (`append`, `appendleft`,
`extendleft`, `popleft`, `remove`, `len`, truth, iteration), plus `peek` and `charge`.
With every request untagged (tenant None, priority 0) there is one line and the queue is
that deque: arrival order, as before. With `enabled=False` (`--scheduling-policy fcfs`)
tenants and priorities are ignored altogether.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

if TYPE_CHECKING:
    from engine.request import Request

USAGE_HALF_LIFE_S = 10.0
"""How fast a tenant's recorded use of the engine fades: halved every this many seconds."""

_Key = tuple[int, "str | None"]


class FairQueue:
    """Waiting requests in one line per (priority, tenant); see the module docstring."""

    def __init__(self, enabled: bool = True, clock: Callable[[], float] = time.monotonic,
                 half_life_s: float = USAGE_HALF_LIFE_S) -> None:
        self.enabled = enabled
        self._clock = clock
        self._half_life_s = half_life_s
        self._lines: dict[_Key, deque[Request]] = {}
        self._len = 0
        self._usage: dict[str | None, float] = {}
        self._usage_time = clock()
        # Lines created earlier win ties (equal priority and usage): first come, first served.
        self._line_order: dict[_Key, int] = {}
        self._seq = itertools.count()
        self.pinned: Request | None = None
        """Set by the scheduler when it freed a sequence slot for this request: the next
        `popleft` returns it whatever the order says by then (the scheduler clears it at the
        end of the step)."""

    # ---- the deque interface ----------------------------------------------------------------
    def _key(self, request: Request) -> _Key:
        if not self.enabled:
            return (0, None)
        return (request.priority, request.tenant)

    def _line(self, request: Request) -> deque[Request]:
        key = self._key(request)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = deque()
            self._line_order[key] = next(self._seq)
        return line

    def append(self, request: Request) -> None:
        self._line(request).append(request)
        self._len += 1

    def appendleft(self, request: Request) -> None:
        self._line(request).appendleft(request)
        self._len += 1

    def extendleft(self, requests: Iterable[Request]) -> None:
        # As deque.extendleft: each goes to the front in turn (callers pass reversed(...)).
        for request in requests:
            self.appendleft(request)

    def popleft(self) -> Request:
        if self.pinned is not None:
            request, self.pinned = self.pinned, None
            self.remove(request)
            return request
        key = self._next_key()
        line = self._lines[key]
        request = line.popleft()
        self._len -= 1
        if not line:
            self._drop(key)
        return request

    def peek(self) -> Request:
        """The request `popleft` would return now."""
        return self._lines[self._next_key()][0]

    def remove(self, request: Request) -> None:
        key = self._key(request)
        line = self._lines.get(key)
        if line is None:
            raise ValueError("request not in the waiting queue")
        line.remove(request)
        if request is self.pinned:
            self.pinned = None
        self._len -= 1
        if not line:
            self._drop(key)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, line by line in the order of `_rank` now (within a line,
        arrival order); `popleft` interleaves tenants as their use changes."""
        for key in sorted(self._lines, key=self._rank):
            yield from self._lines[key]

    # ---- fairness ---------------------------------------------------------------------------
    def usage(self, tenant: str | None) -> float:
        """The tenant's recent tokens (decayed to now)."""
        self._decay()
        return self._usage.get(tenant, 0.0)

    def charge(self, tenant: str | None, num_tokens: int) -> None:
        """Record that the engine computed `num_tokens` tokens for `tenant` this step."""
        self.charge_all({tenant: num_tokens})

    def charge_all(self, tokens_by_tenant: dict[str | None, int]) -> None:
        """`charge` for several tenants at once: one decay for the whole step's batch."""
        if not self.enabled or not tokens_by_tenant:
            return
        self._decay()
        for tenant, num_tokens in tokens_by_tenant.items():
            if num_tokens > 0:
                self._usage[tenant] = self._usage.get(tenant, 0.0) + num_tokens

    def rank(self, request: Request) -> tuple[int, float]:
        """Where `request` stands in the order (smaller is served first): (priority,
        its tenant's recent use). Also how the scheduler picks preemption victims: the
        running request with the largest rank (then the newest) goes first."""
        if not self.enabled:
            return (0, 0.0)
        # Not decayed to now: decay scales every tenant alike, so it never changes the order.
        return (request.priority, self._usage.get(request.tenant, 0.0))

    def tenants(self, priority: int) -> set[str | None]:
        """The tenants with requests waiting at `priority`."""
        return {tenant for p, tenant in self._lines if p == priority}

    def _rank(self, key: _Key) -> tuple[int, float, int]:
        priority, tenant = key
        return (priority, self._usage.get(tenant, 0.0), self._line_order[key])

    def _next_key(self) -> _Key:
        if not self._lines:
            raise IndexError("pop from an empty waiting queue")
        if len(self._lines) == 1:
            return next(iter(self._lines))
        return min(self._lines, key=self._rank)

    def _drop(self, key: _Key) -> None:
        del self._lines[key]
        del self._line_order[key]

    def _decay(self) -> None:
        now = self._clock()
        elapsed = now - self._usage_time
        if elapsed <= 0 or not self._usage:
            self._usage_time = now
            return
        factor = math.pow(0.5, elapsed / self._half_life_s)
        self._usage = {t: u * factor for t, u in self._usage.items() if u * factor >= 1e-3}
        self._usage_time = now

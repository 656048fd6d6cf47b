"""Continuous batching under a token budget, vLLM v1 style.

There is no prefill phase and no decode phase: every request just has tokens not yet
computed (`num_tokens - num_computed_tokens`). Each step, running requests go first
(decodes and unfinished prefill chunks, oldest first), then waiting requests join while
budget, sequence cap and free blocks last. When a running request cannot grow, the newest
running request is preempted (blocks freed, recomputed later), which guarantees the
oldest request always makes progress: no deadlock.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    """Parallel to `scheduled`: new tokens computed for each request this step."""
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, request: Request, budget: int) -> int:
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold is not None:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk(request, budget)
            while not self.block_manager.allocate_slots(request.request_id, request.num_computed_tokens + n):
                victim = self.running.pop()  # the newest; always at index >= i
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status == RequestStatus.PREEMPTED:
                break
            out.scheduled.append(request)
            out.num_scheduled_tokens.append(n)
            budget -= n
            i += 1

        # A step that had to preempt admits nobody: the memory is not there.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            n = self._chunk(request, budget)
            if not self.block_manager.allocate_slots(request.request_id, request.num_computed_tokens + n):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
            out.scheduled.append(request)
            out.num_scheduled_tokens.append(n)
            budget -= n
        return out

    def _preempt(self, request: Request) -> None:
        # Recompute, not swap: the KV is dropped, the tokens (prompt + output so far) kept.
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and release its blocks."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request.request_id)

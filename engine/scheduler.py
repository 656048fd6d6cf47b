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
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) KV blocks to copy before the forward pass (copy-on-write)."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# The shortest prefill chunk the context-scaled cap goes down to.
MIN_PREFILL_CHUNK = 32


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 prefill_context_weight: int | None = None) -> None:
        """`prefill_context_weight`: with it, the prefill chunk cap
        (`long_prefill_token_threshold`) shrinks as the request's context grows, by
        w / (w + context): each new token attends to the whole context, and w is the context
        length whose attention costs as much as the token's pass through the decoder
        linears (`Worker.prefill_context_weight`). A step with a chunk then costs about the
        same at any context, which bounds how long it stalls the streams decoding beside it."""
        self.config = config
        self.prefill_context_weight = prefill_context_weight
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
        cap = self.config.long_prefill_token_threshold
        if cap is not None:
            w = self.prefill_context_weight
            if w:
                cap = max(min(cap, MIN_PREFILL_CHUNK), cap * w // (w + request.num_computed_tokens))
            n = min(n, cap)
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk(request, budget)
            start = request.num_computed_tokens
            while not bm.allocate_slots(request.request_id, start + n, write_from=start):
                victim = self.running.pop()  # the newest; always at index >= i
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status == RequestStatus.PREEMPTED:
                break
            bm.cache_blocks(request, start + n)
            out.scheduled.append(request)
            out.num_scheduled_tokens.append(n)
            budget -= n
            i += 1

        # A step that had to preempt admits nobody: the memory is not there.
        parked: list[Request] = []
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if request.waiting_for_grammar:
                parked.append(request)  # its grammar is still compiling; the others go on
                continue
            parent = request.fork_parent
            if parent is not None and not self._try_fork(request):
                parked.append(request)  # its prompt is still being computed by sample 0
                continue
            cached_prefix = bm.find_cached_prefix(request) if self._may_use_prefix_cache(request) else []
            if cached_prefix:
                request.num_computed_tokens = len(cached_prefix) * bm.block_size
            start = request.num_computed_tokens
            n = self._chunk(request, budget)
            if not bm.allocate_slots(request.request_id, start + n, cached_prefix, write_from=start):
                # Undo: a waiting request holds no blocks and has computed nothing.
                bm.free(request.request_id)
                request.num_computed_tokens = 0
                request.fork_parent = parent
                self.waiting.appendleft(request)
                break
            bm.cache_blocks(request, start + n)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = start
            self.running.append(request)
            out.scheduled.append(request)
            out.num_scheduled_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(parked))
        out.blocks_to_copy = bm.pending_copies
        bm.pending_copies = []
        return out

    @staticmethod
    def _may_use_prefix_cache(request: Request) -> bool:
        # Prompt logprobs exist only for positions the engine computes: a request still
        # missing some must compute its whole prompt (as vLLM does).
        missing_prompt_logprobs = (
            request.prompt_logprobs is not None and len(request.prompt_logprobs) < request.num_prompt_tokens
        )
        return request.num_computed_tokens == 0 and not missing_prompt_logprobs

    def _try_fork(self, request: Request) -> bool:
        """Share sample 0's computed prompt blocks with sample j (n > 1); False = not yet.

        The child recomputes only the last prompt token (its own logits to sample from),
        whose write into the shared partial block triggers copy-on-write.
        """
        parent = request.fork_parent
        last = request.num_prompt_tokens - 1
        if parent.status == RequestStatus.WAITING or (
            parent.status == RequestStatus.RUNNING and parent.num_computed_tokens < last
        ):
            return False
        request.fork_parent = None
        if parent.status != RequestStatus.RUNNING or request.num_computed_tokens or last == 0:
            return True  # parent gone or preempted: compute normally (the prefix cache still helps)
        self.block_manager.fork(parent.request_id, request.request_id, self.block_manager.blocks_needed(last))
        request.num_computed_tokens = last
        return True

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

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.fair_queue import FairQueue
from engine.request import Request, RequestStatus
from engine.spec_decode import propose_ngram

if TYPE_CHECKING:
    from engine.config import NgramSpeculation


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    """Parallel to `scheduled`: new tokens computed for each request this step."""
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) KV blocks to copy before the forward pass (copy-on-write)."""
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens verified this step, by request id (speculative decoding). A request with
    k drafts has 1 + k in `num_scheduled_tokens`: its last real token, then the drafts."""

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
                 prefill_context_weight: int | None = None, speculation: "NgramSpeculation | None" = None) -> None:
        """`prefill_context_weight`: with it, the prefill chunk cap
        (`long_prefill_token_threshold`) shrinks as the request's context grows, by
        w / (w + context): each new token attends to the whole context, and w is the context
        length whose attention costs as much as the token's pass through the decoder
        linears (`Worker.prefill_context_weight`). A step with a chunk then costs about the
        same at any context, which bounds how long it stalls the streams decoding beside it."""
        self.config = config
        self.prefill_context_weight = prefill_context_weight
        # Prompt-lookup speculative decoding (engine/spec_decode.py); None: off.
        self.speculation = speculation
        self.block_manager = block_manager
        # Fair between tenants, by priority first (engine/fair_queue.py); a plain
        # arrival-order deque when no request carries a tenant or priority, or under fcfs.
        self.waiting = FairQueue(enabled=config.scheduling_policy == "fair")
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Most distinct LoRA adapters among the running requests (`--max-loras`: the resident
        # ones, engine/lora.py); None: LoRA off.
        self.max_loras: int | None = None

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

        spec = self.speculation
        if spec is not None and spec.disable_by_batch_size is not None and len(self.running) >= spec.disable_by_batch_size:
            spec = None  # a large batch is no longer memory-bound: verification would cost throughput
        fair_preempted = self._preempt_for_fair_share() if self.waiting.enabled else []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._chunk(request, budget)
            start = request.num_computed_tokens
            drafts = self._propose(request, budget - n, spec) if spec is not None and start + 1 == request.num_tokens else []
            while not bm.allocate_slots(request.request_id, start + n + len(drafts), write_from=start):
                if drafts:
                    drafts = []  # speculation gives way before anyone is preempted
                    continue
                victim = self._pop_victim(i)  # the last in the fair order (else the newest); at index >= i
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status == RequestStatus.PREEMPTED:
                break
            bm.cache_blocks(request, start + n)  # verified tokens only: never a block holding drafts
            out.scheduled.append(request)
            out.num_scheduled_tokens.append(n + len(drafts))
            if drafts:
                out.spec_tokens[request.request_id] = drafts
            budget -= n + len(drafts)
            i += 1

        # The running requests' tokens count towards their tenants' use (fair_queue.py).
        if self.waiting.enabled:
            step_tokens: dict[str | None, int] = {}
            for request, n in zip(out.scheduled, out.num_scheduled_tokens):
                step_tokens[request.tenant] = step_tokens.get(request.tenant, 0) + n
            self.waiting.charge_all(step_tokens)
        # A step that had to preempt admits nobody: the memory is not there.
        parked: list[Request] = []
        running_loras = {r.sampling_params.lora_request.lora_id for r in self.running
                         if r.sampling_params.lora_request is not None} if self.max_loras is not None else set()
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if request.waiting_for_grammar:
                parked.append(request)  # its grammar is still compiling; the others go on
                continue
            lora = request.sampling_params.lora_request
            if lora is not None and lora.lora_id not in running_loras and len(running_loras) >= (self.max_loras or 0):
                parked.append(request)  # its adapter would be one more than --max-loras in the batch
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
            if lora is not None:
                running_loras.add(lora.lora_id)
            out.scheduled.append(request)
            out.num_scheduled_tokens.append(n)
            self.waiting.charge(request.tenant, n)  # so the next pick of this step sees it
            budget -= n
        self.waiting.extendleft(reversed(parked))
        out.preempted[:0] = fair_preempted
        self.waiting.pinned = None
        out.blocks_to_copy = bm.pending_copies
        bm.pending_copies = []
        return out

    @staticmethod
    def _propose(request: Request, budget: int, spec: "NgramSpeculation") -> list[int]:
        """Draft tokens for a decoding request: at most k, what the step's budget leaves,
        and one fewer than the tokens it may still emit (the bonus token takes the last)."""
        k = min(spec.num_speculative_tokens, budget, request.max_tokens - request.num_output_tokens - 1)
        if k <= 0 or (request.thinking is not None and request.thinking.state.thinking):
            # A thinking request gets none: its grammar and budget switch on at a token
            # boundary the drafts could cross.
            return []
        drafts = propose_ngram(request.all_token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        if drafts and request.grammar is not None:
            # Under a grammar, only drafts it allows in a row can ever be accepted.
            matcher = request.grammar.matcher
            drafts = drafts[: matcher.num_allowed_prefix(drafts)] if matcher is not None else []
        return drafts

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

    def _pop_victim(self, first: int) -> Request:
        """Take the running request to preempt out of `running[first:]`: the one that comes
        last in the waiting queue's order (least urgent priority, then the tenant with the
        most recent use), the newest of those. Untagged requests all rank equal, so this is
        the newest running request, as under fcfs."""
        running = self.running
        if not self.waiting.enabled:
            return running.pop()
        rank = self.waiting.rank
        j = max(range(first, len(running)), key=lambda k: (rank(running[k]), k))
        return running.pop(j)

    def _preempt_for_fair_share(self) -> list[Request]:
        """When every sequence slot is taken and the request next in the fair order cannot
        get one, free one for it (recompute preemption), at most one per step:

        - from a running request of a less urgent priority (the last in the fair order), or
        - at the same priority, when its tenant runs fewer requests than its share
          (max_num_seqs / tenants with requests running or waiting), from the tenant running
          the most requests above its share (its newest). A tenant at or below its share
          is never preempted this way, so shares settle instead of swapping back and forth.

        Untagged requests are one tenant, so without tenants or priorities nothing happens."""
        running = self.running
        if len(running) < self.config.max_num_seqs or not self.waiting:
            return []
        head = self.waiting.peek()
        if head.waiting_for_grammar or head.fork_parent is not None:
            return []
        victim_index = None
        lower = [k for k, r in enumerate(running) if r.priority > head.priority]
        if lower:
            rank = self.waiting.rank
            victim_index = max(lower, key=lambda k: (rank(running[k]), k))
        else:
            counts: dict[str | None, int] = {}
            for r in running:
                if r.priority == head.priority:
                    counts[r.tenant] = counts.get(r.tenant, 0) + 1
            tenants = set(counts) | self.waiting.tenants(head.priority)
            share = self.config.max_num_seqs // len(tenants)
            if counts.get(head.tenant, 0) < share:
                over = [t for t, c in counts.items() if c > share and t != head.tenant]
                if over:
                    top = max(over, key=lambda t: (counts[t], self.waiting.usage(t)))
                    victim_index = max(k for k, r in enumerate(running) if r.tenant == top and r.priority == head.priority)
        if victim_index is None:
            return []
        victim = running.pop(victim_index)
        self._preempt(victim)
        self.waiting.pinned = head  # the freed slot is the head's, not the victim's back
        return [victim]

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

    def park(self, request: Request) -> None:
        """Take a running request out of the batch but keep its blocks: a beam that computed
        its step before its siblings (engine/beam_search.py forks its blocks, then frees them)."""
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_STOPPED  # its own part is done; it is never scheduled again

    def add_continuations(self, requests: list[Request], queued: bool = False) -> None:
        """Requests that carry on admitted work (a beam search's next beams) wait at the
        front of their line, as preempted requests do, not behind newcomers. `queued`:
        they are waiting already, and move to the front."""
        if queued:
            for request in requests:
                self.waiting.remove(request)
        self.waiting.extendleft(reversed(requests))

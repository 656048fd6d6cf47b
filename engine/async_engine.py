"""AsyncEngine: EngineCore in a background thread (the engine loop), driven from asyncio.

The loop thread drains an input queue (add/abort), calls `EngineCore.step()`, and hands
each step's outputs to the asyncio loop with one `call_soon_threadsafe` per step. The
event loop never blocks on the engine and the engine never waits for HTTP: a slow or
vanished client only fills its own queue, and `abort` frees its blocks at the next step.

Deadlines (a request's total time, its time waiting to be first scheduled) are enforced
by the loop thread, which owns the scheduler state: an expired request is aborted there
(its blocks freed at once) and its stream gets a typed error.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.engine_core import EngineCore, StepFailedError
from engine.llm import child_params
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.stats import StepStats
from engine.structured_output import GrammarError, StructuredOutputSpec


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a fault in a step, or shutdown); requests cannot complete."""


class QueueFullError(RuntimeError):
    """Too many requests (or prompt tokens) waiting; retry later (HTTP 503 + Retry-After)."""


class QueueTimeoutError(RuntimeError):
    """The request was not scheduled before its queue deadline; it was aborted unstarted."""


class RequestTimeoutError(RuntimeError):
    """The request did not finish before its deadline; it was aborted."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    fork_of: str | None = None
    deadline: float | None = None
    """`time.monotonic()` by which the request must have finished."""
    queue_deadline: float | None = None
    """`time.monotonic()` by which the request must have been scheduled."""
    tenant: str | None = None
    priority: int = 0


@dataclass(slots=True)
class _Abort:
    request_id: str
    status: RequestStatus = RequestStatus.FINISHED_ABORTED
    """FINISHED_STOPPED: ended by the caller's own stop condition (`AsyncEngine.stop`)."""


@dataclass(order=True, slots=True)
class _Timer:
    when: float
    seq: int
    request_id: str = field(compare=False)
    until_scheduled: bool = field(compare=False)
    """A queue deadline: moot once the request has been scheduled."""


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        max_waiting_requests: int = 1024,
        on_step: Callable[[StepStats], None] | None = None,
        max_waiting_tokens: int | None = None,
    ) -> None:
        # The engine thread builds EngineCore and runs every step: all torch work stays on
        # one thread, so there is one OpenMP thread team. A second team (model loaded on the
        # caller's thread, steps on this one) oversubscribes the cores, and libgomp then
        # stops spin-waiting: measured here, a batch-1 decode step went from 20 to 31 ms.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_ready = threading.Event()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(config, on_step), name="pagoda-engine-loop", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        self.config = config
        # The model facts the server reads (it never reaches into `core`).
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self.model_path = self.core.model_path
        self.vocab_size = self.core.model.args.vocab_size
        self.num_kv_blocks = self.core.num_blocks
        self.facts = self.core.facts()
        """What was loaded and how it runs (EngineCore.facts)."""
        self.loras = self.core.loras
        """The LoRA adapter registry (thread-safe; engine/lora.py), None with LoRA off."""
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self._inbox: queue.SimpleQueue[_Add | _Abort | BaseException | None] = queue.SimpleQueue()
        # A fault reported from another thread (a tensor-parallel worker died) ends the loop, even an idle one.
        self.core.on_fatal_error = self._inbox.put
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._on_sample_end: dict[str, tuple[int, Callable[[int, CompletionOutput | None], None]]] = {}
        """Child id -> (its sample index, generate's `on_sample_end`), until the engine ends it."""
        self._stop = threading.Event()
        self._closed = False
        self._timers: list[_Timer] = []  # the loop thread's deadlines, soonest first
        self._timer_seq = itertools.count()
        self.error: BaseException | None = None
        self.last_step_time = time.monotonic()
        # As seen by asyncio (only the event loop writes them):
        self.num_unfinished = 0
        """Samples added and not yet finished."""
        self.unfinished_by_tenant: dict[str, int] = {}
        """Tenant -> its samples added and not yet finished (a server's per-key share of the queue)."""
        self._tenant_of: dict[str, str] = {}
        self.num_waiting_tokens = 0
        """Prompt tokens of requests that have produced no output yet (queued or in prefill)."""

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Begin stepping; call from the event loop that consumes the outputs."""
        self._loop = asyncio.get_running_loop()
        self._loop_ready.set()

    def abort_all(self) -> None:
        """Refuse new requests and abort every unfinished one (the end of a graceful
        shutdown): each stream ends with a last output whose finish_reason is "abort"."""
        self._closed = True
        for child in list(self._streams):
            self._inbox.put(_Abort(child))

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._loop_ready.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # else the worker processes end with this one
            self.core.shutdown()

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._loop is not None and self._thread.is_alive()

    def seconds_since_progress(self) -> float:
        """Time since the last step while work is pending (0 when idle): stall detection."""
        if not self.num_unfinished:
            return 0.0
        return time.monotonic() - self.last_step_time

    # ---- requests ------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return self.core.validate(prompt_token_ids, params)

    def check_capacity(
        self, num_samples: int, num_prompt_tokens: int, reserved_samples: int = 0, reserved_tokens: int = 0
    ) -> None:
        """QueueFullError unless `num_samples` more samples and `num_prompt_tokens` more
        unprefilled prompt tokens fit, besides those `reserved_*` on their way in (the
        server's admissions). An empty token queue takes any prompt, so a prompt longer
        than the token bound waits for a quiet moment instead of failing forever."""
        if num_samples and self.num_unfinished + reserved_samples + num_samples > self.max_waiting_requests:
            raise QueueFullError(f"the server is at its limit of {self.max_waiting_requests} queued requests")
        limit = self.max_waiting_tokens
        queued = self.num_waiting_tokens + reserved_tokens
        if limit is not None and num_prompt_tokens and queued and queued + num_prompt_tokens > limit:
            raise QueueFullError(
                f"the server is at its limit of {limit} queued prompt tokens "
                f"({queued} queued, {num_prompt_tokens} more asked)"
            )

    def set_step_hook(self, hook: Callable[[StepStats], None] | None) -> None:
        """`hook(stats)` after every step and abort, on the engine thread (the server's metrics)."""
        self.core.on_step = hook

    def set_grammar_compile_hook(self, hook: Callable[[str, float, BaseException | None], None] | None) -> None:
        """`hook(kind, seconds, error)` after every grammar compile (on a compile thread)."""
        self.core.structured_output.on_compiled = hook

    async def prepare_structured_output(self, spec: StructuredOutputSpec, timeout_s: float) -> None:
        """Compile `spec` (or find it compiled) before the request is added, so that an
        invalid or too slow grammar fails the request here, before its stream starts.

        Raises GrammarError. A compile past `timeout_s` keeps running on its thread (the
        cache keeps it for an identical request), but this request no longer waits for it.
        """
        future = self.core.structured_output.compile(spec)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except asyncio.TimeoutError as e:
            raise GrammarError(
                f"compiling the {spec.kind} took longer than {timeout_s:g} s; simplify it", spec.param
            ) from e

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        deadline: float | None = None,
        max_queue_time: float | None = None,
        tenant: str | None = None,
        priority: int = 0,
        on_sample_end: Callable[[int, CompletionOutput | None], None] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per step in which any of the n samples advanced.

        Each yielded output carries the advanced samples only (`outputs[i].index` says
        which), with cumulative text/tokens and the step's `delta_text`. Leaving the
        iterator early (client gone) aborts every sample and frees its blocks.

        `deadline` (a `time.monotonic()` value): past it the request is aborted and the
        iterator raises RequestTimeoutError. A sample whose grammar could not be followed
        (`CompletionOutput.error`) makes it raise GrammarError, naming the spec's field. `max_queue_time` (seconds from now): if the
        request is not scheduled by then, it is aborted and QueueTimeoutError is raised.

        `tenant` and `priority` place it in the scheduler's waiting queue: lower priority
        first, then fair between tenants (engine/fair_queue.py).

        `on_sample_end(index, output)` runs on the event loop once per sample when the engine
        ends it: with its last output (finished, stopped or aborted), or None when it ended in
        an error. It runs even after the iterator was left, so a caller counts what the
        engine did rather than what it read: a sample that finished while its stream was
        being closed ends as finished, not as aborted.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        if self._closed:
            raise EngineDeadError("the engine is shutting down")
        self.validate(prompt_token_ids, params)
        self.check_capacity(params.n, len(prompt_token_ids))
        # A beam search is one engine request whose output carries all n beams.
        children = [f"{request_id}-{j}" for j in range(1 if params.use_beam_search else params.n)]
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        for child in children:
            if child in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
        queue_deadline = None if max_queue_time is None else time.monotonic() + max_queue_time
        for j, child in enumerate(children):
            self._streams[child] = stream
            if on_sample_end is not None:
                self._on_sample_end[child] = (j, on_sample_end)
            self.num_unfinished += 1
            if tenant is not None:
                self._tenant_of[child] = tenant
                self.unfinished_by_tenant[tenant] = self.unfinished_by_tenant.get(tenant, 0) + 1
            fork_of = children[0] if j else None
            params_j = params if params.use_beam_search else child_params(params, j)
            self._inbox.put(_Add(child, list(prompt_token_ids), params_j, cache_salt, fork_of, deadline, queue_deadline,
                                 tenant, priority))
        pending = set(children)
        # The prompt counts as waiting until the first output, which means it was prefilled.
        num_waiting_tokens = len(prompt_token_ids)
        self.num_waiting_tokens += num_waiting_tokens
        try:
            while pending:
                item = await stream.get()
                self.num_waiting_tokens -= num_waiting_tokens
                num_waiting_tokens = 0
                if isinstance(item, BaseException):
                    raise item
                batch = [item]
                while not stream.empty():  # merge what else arrived in the same step
                    nxt = stream.get_nowait()
                    if isinstance(nxt, BaseException):
                        raise nxt
                    batch.append(nxt)
                merged = RequestOutput(request_id, None, list(prompt_token_ids))
                for out in batch:
                    for completion in out.outputs:  # one per sample; a beam search's n, indexed 0..n-1
                        if completion.error is not None:  # its grammar could not be followed: the request fails
                            spec = params.structured_output
                            raise GrammarError(completion.error, spec.param if spec is not None else None)
                        completion.index += children.index(out.request_id)
                        merged.outputs.append(completion)
                        if completion.index == 0:
                            merged.prompt_logprobs = out.prompt_logprobs
                            merged.num_cached_tokens = out.num_cached_tokens
                    if out.finished:
                        pending.discard(out.request_id)
                        self._forget(out.request_id)
                merged.finished = not pending
                yield merged
        finally:
            self.num_waiting_tokens -= num_waiting_tokens
            for child in pending:
                self._forget(child)
                self._inbox.put(_Abort(child))

    def _forget(self, child: str) -> None:
        if self._streams.pop(child, None) is not None:
            self.num_unfinished -= 1
            tenant = self._tenant_of.pop(child, None)
            if tenant is not None:
                left = self.unfinished_by_tenant[tenant] - 1
                if left:
                    self.unfinished_by_tenant[tenant] = left
                else:
                    del self.unfinished_by_tenant[tenant]

    def abort(self, request_id: str, n: int = 1) -> None:
        for j in range(n):
            self._inbox.put(_Abort(f"{request_id}-{j}"))

    def stop(self, request_id: str, index: int) -> None:
        """Finish sample `index` of `request_id` now as stopped (finish_reason "stop"): the
        caller found a stop condition of its own (the server's duplicate tool-call guard).
        Its stream gets a last output; a sample that already finished stays as it ended."""
        self._inbox.put(_Abort(f"{request_id}-{index}", RequestStatus.FINISHED_STOPPED))

    # ---- the engine loop (background thread) ----------------------------------------------
    def _main(self, config: EngineConfig, on_step: Callable[[StepStats], None] | None) -> None:
        try:
            self.core = EngineCore(config)
            self.core.on_step = on_step
        except BaseException as e:  # noqa: BLE001 - re-raised on the constructing thread
            self._build_error = e
            return
        finally:
            self._built.set()
        self._loop_ready.wait()
        if not self._stop.is_set():
            self._run()

    def _run(self) -> None:
        core = self.core
        try:
            while not self._stop.is_set():
                # Block only when idle; otherwise take what is queued and step.
                block = not core.has_unfinished_requests()
                while True:
                    try:
                        item = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if item is None:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    if isinstance(item, _Add):
                        try:
                            core.add_request(
                                item.request_id, item.prompt_token_ids, item.params, item.cache_salt, item.fork_of,
                                item.tenant, item.priority,
                            )
                        except ValueError as e:  # validated before; a race is still an error, not a crash
                            self._deliver_error(item.request_id, e)
                        else:
                            self._add_timers(item)
                    elif (aborted := core.abort_request(item.request_id, item.status)) is not None:
                        # Its stream is gone when the client left; at shutdown it gets this last output.
                        self._loop.call_soon_threadsafe(self._deliver, [aborted])
                self.last_step_time = time.monotonic()
                if self._timers:
                    self._expire(core)
                if core.has_unfinished_requests():
                    try:
                        outputs = core.step()
                    except StepFailedError as e:
                        # Only that step's requests fail; the loop keeps serving the rest.
                        for request_id in e.request_ids:
                            self._deliver_error(request_id, e)
                        outputs = []
                    self.last_step_time = time.monotonic()
                    if outputs:
                        self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as e:  # noqa: BLE001 - any fault ends the loop and fails every request
            self.error = e
            self._loop.call_soon_threadsafe(self._fail_all, e)

    def _add_timers(self, item: _Add) -> None:
        # Only sample 0 has a queue deadline: the others wait for its prompt on purpose.
        if item.queue_deadline is not None and item.fork_of is None:
            heapq.heappush(self._timers, _Timer(item.queue_deadline, next(self._timer_seq), item.request_id, True))
        if item.deadline is not None:
            heapq.heappush(self._timers, _Timer(item.deadline, next(self._timer_seq), item.request_id, False))

    def _expire(self, core: EngineCore) -> None:
        """Abort the requests whose deadline passed; their streams get the timeout error."""
        if not core.has_unfinished_requests():
            self._timers.clear()  # every timer left belongs to a finished request
            return
        now = time.monotonic()
        while self._timers and self._timers[0].when <= now:
            timer = heapq.heappop(self._timers)
            request = core.requests.get(timer.request_id)
            if request is None or (timer.until_scheduled and request.first_scheduled_time is not None):
                continue
            core.abort_request(timer.request_id)
            if timer.until_scheduled:
                waited = now - request.arrival_time
                error: RuntimeError = QueueTimeoutError(
                    f"the request waited {waited:.1f} s in the queue without being scheduled; the server is overloaded"
                )
            else:
                error = RequestTimeoutError("the request did not finish before its deadline and was aborted")
            self._deliver_error(timer.request_id, error)

    # ---- on the asyncio loop ----------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished and (ending := self._on_sample_end.pop(out.request_id, None)) is not None:
                first, on_end = ending
                for completion in out.outputs:  # one; a beam search's n, indexed from 0
                    on_end(first + completion.index, completion)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._put_error, request_id, error)

    def _put_error(self, request_id: str, error: BaseException) -> None:
        if (ending := self._on_sample_end.pop(request_id, None)) is not None:
            ending[1](ending[0], None)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine loop failed: {type(error).__name__}: {error}")
        dead.__cause__ = error
        endings, self._on_sample_end = self._on_sample_end, {}
        for index, on_end in endings.values():
            on_end(index, None)
        unique = {id(stream): stream for stream in self._streams.values()}
        for stream in unique.values():
            stream.put_nowait(dead)

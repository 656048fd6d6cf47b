"""AsyncEngine: EngineCore in a background thread (the engine loop), driven from asyncio.

The loop thread drains an input queue (add/abort), calls `EngineCore.step()`, and hands
each step's outputs to the asyncio loop with one `call_soon_threadsafe` per step. The
event loop never blocks on the engine and the engine never waits for HTTP: a slow or
vanished client only fills its own queue, and `abort` frees its blocks at the next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.engine_core import EngineCore, StepFailedError
from engine.llm import child_params
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import StepStats


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a fault in a step, or shutdown); requests cannot complete."""


class QueueFullError(RuntimeError):
    """Too many requests waiting; retry later (HTTP 503 + Retry-After)."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    fork_of: str | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        max_waiting_requests: int = 1024,
        on_step: Callable[[StepStats], None] | None = None,
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
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.last_step_time = time.monotonic()
        self.num_unfinished = 0  # children added and not yet finished, as seen by asyncio

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Begin stepping; call from the event loop that consumes the outputs."""
        self._loop = asyncio.get_running_loop()
        self._loop_ready.set()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._loop_ready.set()
        self._thread.join(timeout=10)

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

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per step in which any of the n samples advanced.

        Each yielded output carries the advanced samples only (`outputs[i].index` says
        which), with cumulative text/tokens and the step's `delta_text`. Leaving the
        iterator early (client gone) aborts every sample and frees its blocks.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        self.validate(prompt_token_ids, params)
        if self.num_unfinished + params.n > self.max_waiting_requests:
            raise QueueFullError(f"the server is at its limit of {self.max_waiting_requests} queued requests")
        children = [f"{request_id}-{j}" for j in range(params.n)]
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        for child in children:
            if child in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
        for j, child in enumerate(children):
            self._streams[child] = stream
            self.num_unfinished += 1
            fork_of = children[0] if j else None
            self._inbox.put(_Add(child, list(prompt_token_ids), child_params(params, j), cache_salt, fork_of))
        pending = set(children)
        try:
            while pending:
                item = await stream.get()
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
                    completion = out.outputs[0]
                    completion.index = children.index(out.request_id)
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
            for child in pending:
                self._forget(child)
                self._inbox.put(_Abort(child))

    def _forget(self, child: str) -> None:
        if self._streams.pop(child, None) is not None:
            self.num_unfinished -= 1

    def abort(self, request_id: str, n: int = 1) -> None:
        for j in range(n):
            self._inbox.put(_Abort(f"{request_id}-{j}"))

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
                    if isinstance(item, _Add):
                        try:
                            core.add_request(
                                item.request_id, item.prompt_token_ids, item.params, item.cache_salt, item.fork_of
                            )
                        except ValueError as e:  # validated before; a race is still an error, not a crash
                            self._deliver_error(item.request_id, e)
                    else:
                        core.abort_request(item.request_id)
                self.last_step_time = time.monotonic()
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

    # ---- on the asyncio loop ----------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._put_error, request_id, error)

    def _put_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine loop failed: {type(error).__name__}: {error}")
        dead.__cause__ = error
        unique = {id(stream): stream for stream in self._streams.values()}
        for stream in unique.values():
            stream.put_nowait(dead)

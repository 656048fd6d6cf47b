"""Graceful shutdown: SIGTERM (or Ctrl+C) drains the server instead of stopping it at once.

The sequence:

1. The signal sets `OpenAIServing.draining`: new generation requests get 503
   `server_draining` + Retry-After and /health answers 503, so load balancers move on;
   the listening socket stays open meanwhile (a refusal says more than a reset).
2. Requests in flight run to their end, for up to `ServerConfig.shutdown_timeout_s`.
3. Those still unfinished are aborted: a stream gets a last chunk with finish_reason
   "abort" then `[DONE]`, a non-streaming request its partial text with finish_reason
   "abort".
4. uvicorn closes the socket, waits up to FLUSH_TIMEOUT_S for responses to be written,
   runs the app's lifespan shutdown (the engine loop stops), and the process exits 0.

A second signal cuts step 2 short. Plain uvicorn would instead close the socket at
once, cut requests off after its `timeout_graceful_shutdown` with a broken response,
and re-raise the signal after shutdown, so the process would die by it (exit status
143, which supervisors read as a crash).
"""

from __future__ import annotations

import asyncio
import sys
import time
from types import FrameType
from typing import Callable

import uvicorn

from server.serving import OpenAIServing

FLUSH_TIMEOUT_S = 5
"""After the drain: how long uvicorn waits for the last responses to be written."""
_POLL_S = 0.05
DEAD_ENGINE_LINGER_S = 2.0
"""After the engine loop died: how long /health answers 503 with the cause before the
process exits, so probes and load balancers read why rather than a refused connection."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server with step 1-3 above in front of its own shutdown."""

    def __init__(self, config: uvicorn.Config, serving: OpenAIServing) -> None:
        super().__init__(config)
        self.serving = serving
        self.hurry = False
        self._drain: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only flags here (new requests are refused from the next
        # bytecode on); the drain task starts at uvicorn's next tick. The signal is not
        # recorded in `_captured_signals`, so uvicorn does not re-raise it at the end.
        if self.serving.draining:
            self.hurry = True
        self.serving.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self.serving.engine.error is not None and self._drain is None:
            # The engine loop died (e.g. a tensor-parallel worker exited) and failed every
            # request: nothing can be served any more, so the server leaves, and
            # `pagoda serve` exits non-zero.
            self.serving.log_engine_death()
            self._drain = asyncio.create_task(self.leave_dead())
        if self.serving.draining and self._drain is None:
            self._drain = asyncio.create_task(self.drain())
        return await super().on_tick(counter)

    async def drain(self) -> None:
        serving = self.serving
        timeout = serving.config.shutdown_timeout_s
        _log(f"shutting down: {serving.num_in_flight} request(s) in flight get up to {timeout:g} s to finish")
        await _wait_until(lambda: not serving.num_in_flight or self.hurry, timeout)
        if serving.num_in_flight:
            _log(f"aborting {serving.num_in_flight} unfinished request(s)")
            serving.engine.abort_all()
            # Each aborted stream gets its last output from the engine loop, unless that died.
            await _wait_until(lambda: not serving.engine.num_unfinished, FLUSH_TIMEOUT_S)
        self.should_exit = True


    async def leave_dead(self) -> None:
        await asyncio.sleep(DEAD_ENGINE_LINGER_S)
        self.should_exit = True


async def _wait_until(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)


def _log(message: str) -> None:
    print(f"[pagoda] {message}", file=sys.stderr, flush=True)

"""Compiling grammars off the engine thread, and each step's token bitmask.

`compile(spec)` hands the work to a small thread pool and returns a future; equal specs
share one compile (an LRU cache keyed by `(kind, value)`, failures included, so a client
resending a bad schema costs nothing). The server awaits that future before it starts a
request's stream, so an invalid grammar is a 400 and a slow compile delays only its own
request. A request added with its grammar still compiling waits in the queue (the
scheduler skips it) while everyone else runs.

Each step the sampler gets the rows that sample under a grammar (`StepGrammars`): it
asks whether a row's grammar allows the token it would pick anyway (cheap), and fills
and applies the full bitmask only for the rows where it does not (or that use top-k/p or
min-p): after penalties and logit bias, before temperature and the filters. Only tokens actually sampled advance a
matcher, so recomputing a preempted request's KV never replays its grammar.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.structured_output.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from engine.structured_output.spec import GrammarError, StructuredOutputSpec

logger = logging.getLogger("pagoda.engine")

MAX_CACHED_GRAMMARS = 256
COMPILE_THREADS = 2
# llguidance recurses over a grammar's rules while compiling: a chain of ~3,000 nested Lark
# rules overflows an 8 MiB stack and kills the process. Compile threads get 256 MiB of
# (virtual, touched-on-demand) stack, which holds ~20,000; StructuredOutputSpec caps a
# grammar's text at 256 KiB (~9,000 such rules).
COMPILE_THREAD_STACK_BYTES = 256 * 2**20


@dataclass(slots=True, eq=False)
class RequestGrammar:
    """A request's grammar: its compile (shared) and its own matcher once compiled."""

    spec: StructuredOutputSpec
    future: "Future[CompiledGrammar]"
    matcher: GrammarMatcher | None = None
    num_rejected: int = field(default=0)
    """Sampled tokens the grammar refused (only when something else forced a token)."""

    @property
    def is_ready(self) -> bool:
        return self.matcher is not None

    def try_start(self) -> bool:
        """Create the matcher once the compile finished; raises GrammarError if it failed."""
        if self.matcher is None and self.future.done():
            self.matcher = self.future.result().new_matcher()
        return self.matcher is not None


CompileHook = Callable[[str, float, "GrammarError | None"], None]
"""(kind, seconds, error or None), called after every compile that ran (not cache hits)."""


class StructuredOutputManager:
    def __init__(self, backend_factory: Callable[[], GrammarBackend]) -> None:
        self._backend_factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self.on_compiled: CompileHook | None = None

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def compile(self, spec: StructuredOutputSpec) -> "Future[CompiledGrammar]":
        """The (possibly shared, possibly finished) compile of `spec`; thread-safe."""
        key = spec.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pagoda-grammar")
            # The pool starts its threads inside submit(): only they get the large stack.
            previous = threading.stack_size(COMPILE_THREAD_STACK_BYTES)
            try:
                future = self._pool.submit(self._compile, spec)
            finally:
                threading.stack_size(previous)
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        t0 = time.perf_counter()
        error: GrammarError | None = None
        try:
            return self.backend.compile(spec)
        except GrammarError as e:
            error = e
            raise
        except Exception as e:  # noqa: BLE001 - a library fault is the grammar's error, never the engine's
            error = GrammarError(f"compiling the {spec.kind} failed: {type(e).__name__}: {e}", spec.param)
            raise error from e
        finally:
            if self.on_compiled is not None:
                self.on_compiled(spec.kind, time.perf_counter() - t0, error)

    def request_grammar(self, spec: StructuredOutputSpec) -> RequestGrammar:
        grammar = RequestGrammar(spec, self.compile(spec))
        grammar.try_start()  # raises at once if the compile already failed
        return grammar

    def fill_bitmask(self, grammars: list[GrammarMatcher]) -> torch.Tensor:
        """Row i: the tokens `grammars[i]` allows next."""
        backend = self.backend
        bitmask = backend.allocate_bitmask(len(grammars))
        backend.fill_bitmask(grammars, bitmask)
        return bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def default_manager(hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> StructuredOutputManager:
    """The llguidance-backed manager; the library loads on the first grammar."""

    def factory() -> GrammarBackend:
        from engine.structured_output.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(hf_tokenizer, vocab_size, eos_token_ids)

    return StructuredOutputManager(factory)


class StepGrammars:
    """One step's constrained rows, for the sampler (engine.sampler.GrammarConstraint)."""

    def __init__(self, manager: StructuredOutputManager, rows: list[int], matchers: list[GrammarMatcher]) -> None:
        self.rows = rows
        self._manager = manager
        self._matcher_of = dict(zip(rows, matchers))

    def allows(self, row: int, token_id: int) -> bool:
        return self._matcher_of[row].allows(token_id)

    def bitmask(self, rows: list[int]) -> torch.Tensor:
        return self._manager.fill_bitmask([self._matcher_of[row] for row in rows])

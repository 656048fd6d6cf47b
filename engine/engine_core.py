"""EngineCore: add/abort requests and `step()` - schedule, one forward pass, sample, update."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.beam_search import BeamSearch, unblock_beam_searches
from engine.block_manager import BlockManager
from engine.kv_events import ZmqEventPublisher
from engine.config import EngineConfig
from engine.cpu_threads import apply_cpu_threads
from engine.default_model import resolve_model_path
from engine.detokenizer import IncrementalDetokenizer
from engine.distributed.executor import TensorParallelError, TensorParallelExecutor
from engine.distributed.parallel_state import cpu_threads_per_rank
from engine.loader import load_hf_config, load_tokenizer
from engine.lora import LoraManager
from engine.model_runner import ModelRunner
from engine.models.llama import ModelArgs
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampler import Sampler, TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import DraftRow, num_accepted
from engine.stats import FinishedRequestStats, StepStats
from engine.structured_output import GrammarError, StepGrammars, default_manager
from engine.thinking import Thinking
from engine.worker import Worker

logger = logging.getLogger("pagoda.engine")


class StepFailedError(RuntimeError):
    """A step's forward pass or sampling raised; `request_ids` were ended, the engine goes on."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed ({type(cause).__name__}: {cause}); {len(request_ids)} request(s) ended")
        self.request_ids = request_ids


class ContextLengthExceeded(ValueError):
    """The prompt (+ max_tokens) does not fit the model's context."""


@dataclass(slots=True)
class EngineStats:
    """Cumulative timings; `1 - forward_time_s / step_time_s` is the engine's own overhead."""

    num_steps: int = 0
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    num_scheduled_tokens: int = 0

    def reset(self) -> None:
        self.num_steps, self.step_time_s, self.forward_time_s, self.num_scheduled_tokens = 0, 0.0, 0.0, 0


class EngineCore:
    """Rank 0's engine: a Worker (the model side), the block manager, scheduler, sampler and
    structured-output manager, and the step that ties them together."""

    def __init__(self, config: EngineConfig, log: bool = True) -> None:
        self.config = config
        mc, cc = config.model, config.cache
        if config.lora.enable_lora and config.parallel.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not supported with --tensor-parallel-size > 1")
        self.model_path = resolve_model_path(mc.model)
        self.tokenizer = load_tokenizer(self.model_path)
        # The CPU kernels' threads: set on this (the engine's) thread before the model loads;
        # tensor-parallel ranks split them (engine/distributed/executor.py).
        self.cpu_threads: str | None = None
        if mc.torch_device.type == "cpu":
            tp = config.parallel.tensor_parallel_size
            self.cpu_threads = (apply_cpu_threads(config.kernel.cpu_threads) if tp == 1 else
                                f"{cpu_threads_per_rank(tp, config.kernel.cpu_threads)} per rank, {tp} ranks")
        # Tensor parallelism: the worker ranks start here; rank 0's Worker holds its shard.
        self.executor: TensorParallelExecutor | None = None
        if config.parallel.tensor_parallel_size > 1:
            args = ModelArgs.from_hf_config(load_hf_config(self.model_path))
            self.executor = TensorParallelExecutor(config, args)
            self.executor.on_failure = self._fatal_error
        try:
            self.worker = Worker(
                config, self.model_path, self.executor.placement if self.executor is not None else None, log
            )
        except BaseException:
            if self.executor is not None:
                self.executor.shutdown()
            raise
        eos_ids = _eos_token_ids(self.model_path, self.tokenizer)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        # Llama-3-style configs list several end tokens; the rest stop like stop_token_ids.
        self.extra_eos_token_ids = eos_ids[1:]
        self.block_manager = BlockManager(self.worker.num_blocks, cc.block_size, cc.enable_prefix_caching)
        # KV-cache events (engine/kv_events.py): the block manager records them, each step's
        # go to the publisher's thread as one batch.
        self.kv_events: ZmqEventPublisher | None = None
        kv_events_config = cc.kv_events
        if kv_events_config is not None and kv_events_config.enabled:
            self.kv_events = ZmqEventPublisher(kv_events_config)
            self.block_manager.events = []
            self.block_manager.events_medium = "GPU" if self.worker.device.type == "cuda" else "CPU"
        # On CPU without an explicit prefill cap: the default cap, scaled down with context.
        context_weight = None
        if self.worker.device.type == "cpu" and config.scheduler.long_prefill_token_threshold is None:
            context_weight = self.worker.prefill_context_weight()
        self.speculation = config.speculative.ngram
        self.scheduler = Scheduler(
            config.scheduler.for_device(self.worker.device), self.block_manager, context_weight, self.speculation
        )
        if self.executor is not None:
            self.executor.worker = self.worker
        self.runner = ModelRunner(
            self.worker, self.block_manager,
            forward_step=self.executor.run_step if self.executor is not None else None,
            decode_graphs=self.worker.capture_decode_graphs(self.block_manager, log),
        )
        # LoRA adapters over the base weights (engine/lora.py); the start-up ones load here.
        self.loras: LoraManager | None = None
        if config.lora.enable_lora:
            self.loras = LoraManager(config.lora, self.worker.model, self.worker.dtype, self.worker.device)
            self.runner.lora = self.loras
            self.scheduler.max_loras = config.lora.max_loras
        if log:
            for name, value in self.facts().items():
                print(f"[pagoda] {name}: {value}", file=sys.stderr, flush=True)
            for fallback in self.worker.fallbacks():
                print(f"[pagoda] fallback: {fallback}", file=sys.stderr, flush=True)
        self.sampler = Sampler(mc.seed)
        # Grammars compile on the manager's threads; the engine fills and applies masks.
        self.structured_output = default_manager(self.tokenizer, self.model.args.vocab_size, eos_ids)
        self._grammar_waiting: list[Request] = []
        """Requests added while their grammar was still compiling (the scheduler skips them)."""
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.debug_invariants = os.environ.get("PAGODA_DEBUG_INVARIANTS") == "1"
        # Called after every step (and abort) with that step's StepStats; the server's
        # metrics hook. None skips building them.
        self.on_step: Callable[[StepStats], None] | None = None
        # Called from another thread when the engine can no longer step, even while idle
        # (a tensor-parallel worker died); the engine loop's owner ends the loop.
        self.on_fatal_error: Callable[[BaseException], None] | None = None
        self._reported_queries = self._reported_hits = 0
        # Fault injection for tests: the N-th step (1-based) raises inside the forward pass.
        fault = os.environ.get("PAGODA_FAULT_AT_STEP")
        self._fault_at_step = int(fault) if fault else None  # block-manager counters already in StepStats

    def facts(self) -> dict[str, str]:
        """What runs: the Worker's facts plus the scheduler's and cache's settings (the
        start-up log and the `pagoda:engine_info` metric)."""
        sc, cc = self.config.scheduler, self.config.cache
        return {
            **self.worker.facts(),
            "cuda_graphs": "on (decode)" if self.runner.decode_graphs is not None else "off (every step eager)",
            "tensor_parallel_size": str(self.config.parallel.tensor_parallel_size),
            **({"cpu_threads": self.cpu_threads} if self.cpu_threads is not None else {}),
            "max_num_seqs": str(sc.max_num_seqs),
            "max_num_batched_tokens": str(sc.max_num_batched_tokens),
            "prefix_caching": "on" if cc.enable_prefix_caching else "off",
            "speculative_decoding": _describe_speculation(self.speculation),
            "lora": "off" if self.loras is None else (
                f"max {self.config.lora.max_loras} resident, rank <= {self.config.lora.max_lora_rank}, adapters: "
                f"{', '.join(self.loras.names()) or 'none'}"
            ),
        }

    # ---- the model side's facts (read-only) ------------------------------------------------
    @property
    def model(self):
        return self.worker.model

    @property
    def device(self) -> torch.device:
        return self.worker.device

    @property
    def dtype(self) -> torch.dtype:
        return self.worker.dtype

    @property
    def ops(self):
        return self.worker.ops

    @property
    def kv_spec(self):
        return self.worker.kv_spec

    @property
    def num_blocks(self) -> int:
        return self.worker.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.worker.max_model_len

    # ---- requests ------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the limits; returns its resolved max_tokens.

        Reads only immutable configuration, so the server calls it from any thread to turn
        a bad request into an error before it reaches the engine loop.
        """
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        num_prompt = len(prompt_token_ids)
        room = self.max_model_len - num_prompt
        if room < 0 or (params.max_tokens is not None and params.max_tokens > room):
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt + (params.max_tokens or 0)} were requested ({num_prompt} in the prompt, "
                f"{params.max_tokens} to generate)"
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        # A request whose whole sequence cannot fit the cache even alone would wait forever.
        needed = self.block_manager.blocks_needed(num_prompt + max_tokens)
        if params.use_beam_search:
            needed *= params.n  # what its n beams hold at most: no sharing assumed
        if needed > self.num_blocks:
            raise ValueError(
                f"the request needs {needed} KV blocks for {num_prompt + max_tokens} tokens"
                f"{f' x {params.n} beams' if params.use_beam_search else ''} but the cache "
                f"has only {self.num_blocks}; lower max_tokens or raise --kv-cache-memory"
            )
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        fork_of: str | None = None,
        tenant: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a single-sample request. n > 1 is fanned out above this layer into samples
        whose `fork_of` names sample 0: they share its prompt blocks instead of recomputing."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        if self.extra_eos_token_ids and not params.ignore_eos:
            extra = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_id, max_tokens, cache_salt=cache_salt)
        request.tenant, request.priority = tenant, priority  # the scheduler's fair order (engine/fair_queue.py)
        if params.use_beam_search:
            # One request for the n beams: it stands for them, they run (engine/beam_search.py).
            self.requests[request_id] = request
            BeamSearch.start(self, request)
            return
        if params.structured_output is not None:
            # Raises GrammarError (a ValueError) here if the compile already failed.
            request.grammar = self.structured_output.request_grammar(params.structured_output)
        parent = self.requests.get(fork_of) if fork_of is not None else None
        if parent is not None and parent.prompt_token_ids == request.prompt_token_ids:
            request.fork_parent = parent
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        if params.thinking is not None:
            request.thinking = Thinking(params.thinking, IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, [], skip_special_tokens=params.skip_special_tokens))
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        if request.waiting_for_grammar:
            self._grammar_waiting.append(request)

    def abort_request(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> RequestOutput | None:
        """End a request now; its last output, or None when it had already finished.
        `status` FINISHED_STOPPED: the caller found a stop condition of its own, so the
        request finishes as stopped ("stop") rather than aborted."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        stats = None
        if self.on_step is not None:
            stats = self._new_step_stats(None)
        if request.beam_search is not None:
            output = request.beam_search.abort(stats)
        else:
            self._finish(request, status, stats)
            output = self._make_output(request)
        if stats is not None:
            self._report(stats)
        return output

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (a no-op otherwise)."""
        if self.executor is not None:
            self.executor.shutdown()
        self.structured_output.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def _fatal_error(self, error: BaseException) -> None:
        if self.on_fatal_error is not None:
            self.on_fatal_error(error)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        failed_grammars = self._start_grammars() if self._grammar_waiting else []
        preemptions_before = self.scheduler.num_preemptions
        sched = self.scheduler.schedule()
        if sched.is_empty:
            # Beams parked for their siblings hold blocks: when nothing can run, beam searches
            # must not wait on each other's (engine/beam_search.py).
            unblock_beam_searches(self)
            if self._grammar_waiting:
                # Only compiling requests are left: wait for a compile instead of spinning.
                concurrent.futures.wait(
                    [r.grammar.future for r in self._grammar_waiting], timeout=0.01,
                    return_when=concurrent.futures.FIRST_COMPLETED,
                )
            return failed_grammars
        stats = self._new_step_stats(sched) if self.on_step is not None else None
        try:
            with torch.inference_mode():
                if self._fault_at_step is not None and self.stats.num_steps + 1 == self._fault_at_step:
                    raise RuntimeError(f"injected fault in step {self._fault_at_step} (PAGODA_FAULT_AT_STEP)")
                t1 = time.perf_counter()
                logits = self.runner.execute(sched)
                t2 = time.perf_counter()
                spec = sched.spec_tokens
                sampling = [
                    r for r, n in zip(sched.scheduled, sched.num_scheduled_tokens)
                    if r.num_computed_tokens + n - len(spec.get(r.request_id, ())) == r.num_tokens
                ]
                # One sampler row per sampling request; 1 + k for one verifying k drafts.
                rows = _sampler_rows(sampling, spec) if spec else sampling
                sampled = self.sampler(logits, rows, self._step_grammars(rows), _forced_tokens(rows)) if rows else None
                if self.runner.prompt_rows:  # after the sampler's wait: their transfer is ready
                    self._record_prompt_logprobs()
            outputs = failed_grammars + self._update(sched, sampling, sampled, stats)
        except TensorParallelError:
            raise  # the ranks are out of step: no later step can run
        except Exception as e:
            self.stats.num_steps += 1
            raise self._fail_step(sched, e) from e
        if self.debug_invariants:
            self.block_manager.check_invariants()
        t3 = time.perf_counter()
        st = self.stats
        st.num_steps += 1
        st.step_time_s += t3 - t0
        st.forward_time_s += t2 - t1
        st.num_scheduled_tokens += sched.total_num_scheduled_tokens
        self._publish_kv_events(stats)
        if stats is not None:
            stats.num_preemptions = self.scheduler.num_preemptions - preemptions_before
            self._report(stats)
        return outputs

    def _start_grammars(self) -> list[RequestOutput]:
        """Give each request whose grammar finished compiling its matcher; a request whose
        compile failed ends with "abort" (the server compiles before adding, so only
        Python-API callers that did not wait for `structured_output.compile` see this)."""
        outputs, still_waiting = [], []
        for request in self._grammar_waiting:
            if request.is_finished:
                continue
            try:
                if not request.grammar.try_start():
                    still_waiting.append(request)
            except GrammarError as e:
                logger.warning("request %s: %s", request.request_id, e)
                request.stop_reason = str(e)
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                outputs.append(self._make_output(request))
        self._grammar_waiting = still_waiting
        return outputs

    def _step_grammars(self, sampling: list) -> StepGrammars | None:
        """This step's grammar-constrained sampling rows; None when there are none.

        A draft row (speculative decoding) gets a copy of its request's matcher advanced
        through the drafts before it; the request's own matcher is advanced afterwards by
        the tokens actually emitted (`_update`), so nothing needs rolling back."""
        rows = [i for i, r in enumerate(sampling)
                if r.grammar is not None and r.max_tokens > 0 and not _is_thinking(r)]
        if not rows:
            return None
        matchers = []
        for i in rows:
            row = sampling[i]
            if isinstance(row, DraftRow):
                previous = matchers[-1]  # the row before: the same request, one draft fewer
                matcher = previous.copy()
                matcher.accept_token(row.output_token_ids[-1])
            else:
                matcher = row.grammar.matcher
            matchers.append(matcher)
        return StepGrammars(self.structured_output, rows, matchers)

    def _fail_step(self, sched: SchedulerOutput, error: Exception) -> "StepFailedError":
        """A step raised: end its requests (the others are untouched) and keep the engine usable.

        Blocks registered in the prefix cache this step may never have been written, so
        the whole cache index is dropped (cached KV is an optimisation, never a source of
        truth); the failed requests' blocks go back to the free list.
        """
        failed = [r.request_id for r in sched.scheduled if not r.is_finished and r.beam_search is None]
        stats = self._new_step_stats(sched) if self.on_step is not None else None
        for request_id in failed:
            self._finish(self.requests[request_id], RequestStatus.FINISHED_ABORTED, stats)
        for search in {r.beam_search for r in sched.scheduled if r.beam_search is not None}:
            if search.main.request_id in self.requests:  # its beams fail with the step: so does it
                search.abort(stats)
                failed.append(search.request_id)
        self.block_manager.reset_prefix_cache()
        self._publish_kv_events(stats)
        if stats is not None:
            self._report(stats)
        return StepFailedError(failed, error)

    def _publish_kv_events(self, stats: StepStats | None) -> None:
        """Hand this step's KV-cache events to the publisher as one batch (never blocks; a
        full queue drops the batch, counted in the stats)."""
        if self.kv_events is None:
            return
        events = self.block_manager.take_events()
        if events and not self.kv_events.publish(events) and stats is not None:
            stats.kv_events_dropped += len(events)

    def _new_step_stats(self, sched: SchedulerOutput | None) -> StepStats:
        """Counters start at zero; the gauges are filled by _report after the change."""
        return StepStats(
            num_running=0, num_waiting=0, kv_cache_usage=0.0, kv_cache_tail_waste_tokens=0,
            num_scheduled_tokens=0 if sched is None else sched.total_num_scheduled_tokens,
        )

    def _report(self, stats: StepStats) -> None:
        """Fill the gauges from the state after the step and hand the stats to on_step."""
        stats.num_running = len(self.scheduler.running)
        stats.num_waiting = len(self.scheduler.waiting)
        stats.kv_cache_usage = self.block_manager.usage
        bm = self.block_manager
        stats.prefix_cache_queries = bm.prefix_cache_queries - self._reported_queries
        stats.prefix_cache_hits = bm.prefix_cache_hits - self._reported_hits
        self._reported_queries, self._reported_hits = bm.prefix_cache_queries, bm.prefix_cache_hits
        stats.kv_cache_tail_waste_tokens = sum(
            self.block_manager.tail_waste(r.request_id, r.num_computed_tokens) for r in self.scheduler.running
        )
        if self.loras is not None:
            stats.lora_adapters = self.loras.step_adapters(self.scheduler.running, self.scheduler.waiting)
        self.on_step(stats)

    def _update(self, sched, sampling: list[Request], sampled, stats: StepStats | None) -> list[RequestOutput]:
        for request, n in zip(sched.scheduled, sched.num_scheduled_tokens):
            request.num_computed_tokens += n
        spec = sched.spec_tokens
        outputs = []
        now = time.monotonic()
        row = 0  # the request's first sampler row
        for request in sampling:
            drafts = spec.get(request.request_id, ()) if spec else ()
            rows = range(row, row + 1 + len(drafts))
            row = rows.stop
            if request.beam_search is not None:  # a beam: its logprobs go to its search, no token is appended
                if (done := request.beam_search.on_logprobs(request, sampled.logprobs[rows.start], stats)) is not None:
                    outputs.append(done)
                continue
            if request.max_tokens == 0:
                self._finish(request, RequestStatus.FINISHED_LENGTH, stats)
                outputs.append(self._make_output(request))
                continue
            tokens = sampled.token_ids[rows.start:rows.stop]
            if drafts:
                # Keep the drafts the model agrees with, then its own token at the first
                # disagreement (or the bonus token); the rejected drafts' KV is not computed.
                accepted = num_accepted(list(drafts), tokens)
                tokens = tokens[: accepted + 1]
                request.num_computed_tokens -= len(drafts) - accepted
                if stats is not None:
                    stats.spec_num_drafts += 1
                    stats.spec_num_draft_tokens += len(drafts)
                    stats.spec_num_accepted_tokens += accepted
                    stats.spec_accepted_per_position.extend(range(accepted))
            if stats is not None:
                if request.first_token_time is None:
                    stats.num_prompt_tokens += request.num_prompt_tokens
                    stats.time_to_first_token_s.append(now - request.arrival_time)
                elif request.last_token_time is not None:
                    # Tokens that arrive together share the wait: one gap each, evenly split.
                    gap = (now - request.last_token_time) / len(tokens)
                    stats.inter_token_latency_s.extend([gap] * len(tokens))
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            for token, i in zip(tokens, rows):
                is_answer = request.thinking is None or request.thinking.advance(token)
                if is_answer and request.grammar is not None and not request.grammar.matcher.accept_token(token):
                    self._fail_grammar(request, token, stats)
                    break  # the token that broke the grammar is not part of the output
                request.output_token_ids.append(token)
                if stats is not None:
                    stats.num_generation_tokens += 1
                if sampled.logprobs[i] is not None:
                    request.logprobs.append(self._decode_logprobs(sampled.logprobs[i]))
                status = self._check_stop(request, token, is_answer)
                if status is not None:
                    self._finish(request, status, stats)
                    break  # tokens after a stop are never emitted
            if drafts and not request.is_finished:
                self.block_manager.truncate(request.request_id, request.num_computed_tokens + 1)
            outputs.append(self._make_output(request))
        return outputs

    def _record_prompt_logprobs(self) -> None:
        """The step's prompt logprobs (reduced on the device by the forward pass), in one transfer."""
        for lp, (request, _) in zip(self.runner.prompt_logprobs.to_host(), self.runner.prompt_rows):
            request.prompt_logprobs.append(self._decode_logprobs(lp))

    def _fail_grammar(self, request: Request, token: int, stats: StepStats | None) -> None:
        """The sampled token is outside the request's grammar: its matcher failed on the way
        (a parser or lexer limit reached mid-output) and masked every token, or something
        forced a token the grammar refuses. The request ends with "abort" and an `error`
        (never "stop" with output that breaks its grammar)."""
        grammar = request.grammar
        grammar.num_rejected += 1
        spec = grammar.spec
        request.error = (f"the output could not follow the {spec.param or 'structured output'}'s {spec.kind} "
                         f"after {request.num_output_tokens} tokens: the grammar allowed no token there; "
                         "simplify it")
        logger.warning("request %s: sampled token %d is outside its grammar: %s", request.request_id, token,
                       request.error)
        self._finish(request, RequestStatus.FINISHED_ABORTED, stats)

    def _check_stop(self, request: Request, token: int, is_answer: bool = True) -> RequestStatus | None:
        p = request.sampling_params
        n = request.num_output_tokens
        if n >= p.min_tokens:
            if token == request.eos_token_id and not p.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        # Stop strings and the grammar are the answer's: the thinking cannot end the request.
        if request.detokenizer is not None and is_answer:
            stop_str = request.detokenizer.update([token])
            if stop_str is not None:
                request.stop_reason = stop_str
                return RequestStatus.FINISHED_STOPPED
        if is_answer and request.grammar is not None and request.grammar.matcher.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if n >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, stats: StepStats | None = None) -> None:
        self.scheduler.finish(request, status)
        del self.requests[request.request_id]
        if stats is not None:
            now = time.monotonic()
            queued = None if request.first_scheduled_time is None else request.first_scheduled_time - request.arrival_time
            stats.finished.append(
                FinishedRequestStats(
                    finish_reason=status.finish_reason or "abort",
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_generation_tokens=request.num_output_tokens,
                    e2e_latency_s=now - request.arrival_time,
                    queue_time_s=queued,
                    tenant=request.tenant,
                    time_to_first_token_s=(
                        None if request.first_token_time is None else request.first_token_time - request.arrival_time
                    ),
                )
            )

    def _decode_logprobs(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        return {
            t: Logprob(v, r, self.tokenizer.decode([t]))
            for t, v, r in zip(lp.token_ids, lp.logprobs, lp.ranks)
        }

    def _make_output(self, request: Request) -> RequestOutput:
        detok = request.detokenizer
        text = detok.output_text if detok is not None else ""
        delta = detok.get_delta_text(request.is_finished) if detok is not None else ""
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            logprobs=request.logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            delta_text=delta,
            error=request.error,
        )
        if (thinking := request.thinking) is not None:
            if request.is_finished:
                thinking.finish()
            completion.reasoning_text = thinking.detokenizer.output_text
            completion.delta_reasoning_text = thinking.detokenizer.get_delta_text(request.is_finished)
            completion.num_reasoning_tokens = thinking.num_reasoning_tokens
        return RequestOutput(
            request_id=request.request_id,
            prompt=None,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            prompt_logprobs=request.prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
        )


def _is_thinking(row) -> bool:
    """The row's next token is (or may be) thinking, which no grammar constrains."""
    return row.thinking is not None and row.thinking.state.thinking


def _forced_tokens(rows: list) -> dict[int, int] | None:
    """Sampler row -> the token it must take: the end of a thinking whose budget is spent.
    Thinking requests have no draft rows (Scheduler._propose), so each is one row."""
    forced = {}
    for i, row in enumerate(rows):
        if row.thinking is not None and (token := row.thinking.state.forced_token()) is not None:
            forced[i] = token
    return forced or None


def _sampler_rows(sampling: list[Request], spec_tokens: dict[str, list[int]]) -> list:
    """The sampler's rows: a request without drafts is one row; one verifying k drafts is
    1 + k rows, row j seeing the first j drafts as output (engine/spec_decode.py)."""
    rows: list = []
    for request in sampling:
        rows.append(request)
        drafts = spec_tokens.get(request.request_id, ())
        rows.extend(DraftRow(request, drafts[:j]) for j in range(1, len(drafts) + 1))
    return rows


def _describe_speculation(spec) -> str:
    if spec is None:
        return "off"
    cutoff = "" if spec.disable_by_batch_size is None else f", off at >= {spec.disable_by_batch_size} running"
    return (f"ngram, k={spec.num_speculative_tokens}, "
            f"n-gram {spec.prompt_lookup_min}..{spec.prompt_lookup_max}{cutoff}")


def _eos_token_ids(model_path, tokenizer) -> list[int]:
    """End-of-sequence ids: generation_config, then config, then the tokenizer's."""
    from transformers import AutoConfig, GenerationConfig

    eos = None
    try:
        eos = GenerationConfig.from_pretrained(str(model_path)).eos_token_id
    except OSError:  # no generation_config.json
        pass
    if eos is None:
        eos = getattr(AutoConfig.from_pretrained(str(model_path)), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(t) for t in eos] if isinstance(eos, (list, tuple)) else [int(eos)]

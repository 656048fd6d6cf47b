"""Beam search inside the engine, over the paged KV cache: beams fork by reference.

`SamplingParams(use_beam_search=True, n=N, length_penalty=L)` asks for the N best sequences
of a beam search of width N (vLLM's request fields). The search is Hugging Face's
`generate(num_beams=N, do_sample=False, length_penalty=L)` (its default early stopping),
step by step:

- every running beam's next-token log-probabilities (the raw distribution, as the sampler
  reports logprobs) are added to its cumulative log-probability; the top K = max(2, 1 + s)
  x N candidates over all beams are kept, s being the number of stop tokens (EOS and
  `stop_token_ids`; none of EOS with `ignore_eos`). Each beam's own top K suffice, so each
  beam asks the sampler for K logprobs and nothing else changes in the sampler;
- a candidate ending in a stop token, or reaching `max_tokens`, finishes if it ranks among
  the first N; its score is cumulative log-probability / (generated tokens ** L), the stop
  token counted. The N best finished hypotheses are kept;
- the N best candidates that did not finish are the next beams;
- the search ends when every candidate finished (`max_tokens`), or when the best running
  beam, scored at its current length, cannot beat the worst of N finished hypotheses
  (Hugging Face's `early_stopping=False` heuristic). The N hypotheses come out best first.

The KV cache: each beam is an ordinary engine `Request` that computes one token per step
(its newest). The first computes the prompt. When a step's candidates are chosen, a new
beam takes its parent's block table by reference (`BlockManager.fork`) and computes only
its own new token; writing that token into the parent's last, partly filled block makes a
private copy of that one block first (copy-on-write, `BlockManager.allocate_slots`). Full
blocks, the prompt's and the generated ones, stay shared by every beam descending from
them, so N beams hold the shared prefix once plus about one block each. Nothing is
recomputed, except after a preemption (as for any request). A beam that computed its step
before its siblings did waits "parked": out of the batch, its blocks kept, until the whole
step's candidates are known.

A beam search is one request to its callers (`AsyncEngine.generate`, `LLM.generate`): one
`RequestOutput` at the end, with the N beams as outputs 0..N-1, best first (as vLLM).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from engine.request import Request, RequestStatus
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from engine.stats import StepStats


@dataclass(slots=True)
class _Beam:
    request: Request
    """The engine request that computes this beam's newest token (prompt + its tokens)."""
    cum_logprob: float
    logprobs: SampleLogprobs | None
    result: TokenLogprobs | None = None
    """This step's next-token logprobs (the top K), once computed."""


@dataclass(slots=True)
class _Hypothesis:
    token_ids: list[int]
    score: float
    stop_token: int | None
    """The stop token that ended it; None when max_tokens did."""
    logprobs: SampleLogprobs | None


@dataclass(slots=True)
class _Candidate:
    cum_logprob: float
    beam: int
    token: int
    logprob: float
    rank: int
    """1-based rank of `token` in its beam's next-token distribution."""


@dataclass(eq=False)
class BeamSearch:
    """One beam search: its beams' requests in the engine, its finished hypotheses.

    `main` stands for the whole search in `EngineCore.requests` (under the caller's request
    id: deadlines, abort, metrics); it is never scheduled. The beams' requests are named
    `{request_id}/beam-{step}-{j}`."""

    core: "EngineCore"
    main: Request
    stop_token_ids: frozenset[int]
    width: int = 0
    num_candidates: int = 0
    beams: list[_Beam] = field(default_factory=list)
    hypotheses: list[_Hypothesis] = field(default_factory=list)
    step: int = 0
    root: Request | None = None
    """The first beam (it computes the prompt: cached tokens and prompt logprobs come from it)."""

    @classmethod
    def start(cls, core: "EngineCore", main: Request) -> "BeamSearch":
        p = main.sampling_params
        stops = set(p.stop_token_ids)
        if main.eos_token_id is not None and not p.ignore_eos:
            stops.add(main.eos_token_id)
        search = cls(core, main, frozenset(stops), width=p.n)
        search.num_candidates = max(2, 1 + len(stops)) * p.n
        main.beam_search = search
        root = search._new_request([], prompt_logprobs=p.prompt_logprobs)
        search.root = root
        search.beams.append(_Beam(root, 0.0, [] if p.logprobs is not None else None))
        core.scheduler.add_request(root)
        return search

    @property
    def request_id(self) -> str:
        return self.main.request_id

    def _new_request(self, output_token_ids: list[int], prompt_logprobs: int | None = None) -> Request:
        main = self.main
        k = max(self.num_candidates, main.sampling_params.logprobs or 0)
        # A greedy one-token request that reports its top k: its max_tokens (one more than
        # it has) also keeps the speculative proposer away from it.
        params = SamplingParams(temperature=0.0, max_tokens=None, logprobs=k, prompt_logprobs=prompt_logprobs,
                                lora_request=main.sampling_params.lora_request)  # the search's adapter
        request_id = f"{main.request_id}/beam-{self.step}-{len(self.beams)}"
        request = Request(
            request_id, main.prompt_token_ids, params, None, len(output_token_ids) + 1,
            cache_salt=main.cache_salt, output_token_ids=list(output_token_ids),
        )
        request.tenant, request.priority, request.beam_search = main.tenant, main.priority, self
        self.core.requests[request_id] = request
        return request

    # ---- the engine's calls ----------------------------------------------------------------
    def on_logprobs(self, request: Request, logprobs: TokenLogprobs, stats: "StepStats | None") -> RequestOutput | None:
        """A beam computed its next-token logprobs this step. Once every beam has, the step's
        candidates are chosen; returns the search's output when it ended."""
        if self.main.first_scheduled_time is None:
            self.main.first_scheduled_time = request.first_scheduled_time
            self.main.num_cached_tokens = request.num_cached_tokens
        beam = next(b for b in self.beams if b.request is request)
        beam.result = logprobs
        self.core.scheduler.park(request)
        if any(b.result is None for b in self.beams):
            return None
        return self._advance(stats)

    def release_parked(self) -> None:
        """Drop the blocks of the beams parked for their siblings: they recompute later (the
        prefix cache may still hold their blocks), as preempted requests do."""
        for beam in self.beams:
            if beam.result is not None:
                request = beam.request
                self.core.block_manager.free(request.request_id)
                request.num_computed_tokens = 0
                request.status = RequestStatus.PREEMPTED
                request.num_preemptions += 1
                beam.result = None
                self.core.scheduler.add_request(request)

    def abort(self, stats: "StepStats | None") -> RequestOutput:
        self._release_beams()
        self._end(RequestStatus.FINISHED_ABORTED, stats)
        return self.core._make_output(self.main)

    # ---- the algorithm ---------------------------------------------------------------------
    def _advance(self, stats: "StepStats | None") -> RequestOutput | None:
        p = self.main.sampling_params
        n = self.width
        num_generated = self.beams[0].request.num_output_tokens + 1  # what every candidate holds
        may_stop = num_generated > p.min_tokens  # min_tokens masks the stop tokens before
        candidates = []
        for b, beam in enumerate(self.beams):
            top = beam.result
            # The sampler's entries: the greedy token first, then the top k in order.
            for rank, (token, logprob) in enumerate(zip(top.token_ids[1:], top.logprobs[1:]), start=1):
                if rank > self.num_candidates:
                    break
                if not may_stop and token in self.stop_token_ids:
                    continue
                candidates.append(_Candidate(beam.cum_logprob + logprob, b, token, logprob, rank))
        candidates.sort(key=lambda c: -c.cum_logprob)  # stable: ties stay in beam, then rank order
        candidates = candidates[: self.num_candidates]
        last = num_generated >= self.main.max_tokens
        running: list[_Candidate] = []
        for i, c in enumerate(candidates):
            if last or c.token in self.stop_token_ids:
                if i < n:  # only the first n may finish; the rest exist to keep n beams running
                    self._add_hypothesis(c, num_generated, None if last and c.token not in self.stop_token_ids else c.token)
            elif len(running) < n:
                running.append(c)
        if not running or self._cannot_improve(running[0], num_generated):
            self._release_beams()
            return self._finish(stats)
        self._fork(running)
        return None

    def _add_hypothesis(self, c: _Candidate, num_generated: int, stop_token: int | None) -> None:
        beam = self.beams[c.beam]
        score = c.cum_logprob / (num_generated ** self.main.sampling_params.length_penalty)
        logprobs = None if beam.logprobs is None else beam.logprobs + [self._entry(beam, c)]
        self.hypotheses.append(_Hypothesis(beam.request.output_token_ids + [c.token], score, stop_token, logprobs))
        self.hypotheses.sort(key=lambda h: -h.score)
        del self.hypotheses[self.width:]

    def _cannot_improve(self, best: _Candidate, num_generated: int) -> bool:
        """Hugging Face's early_stopping=False: the best running beam, scored at its current
        length, is no better than the worst of n finished hypotheses."""
        if len(self.hypotheses) < self.width:
            return False
        score = best.cum_logprob / (num_generated ** self.main.sampling_params.length_penalty)
        return score <= self.hypotheses[-1].score

    def _entry(self, beam: _Beam, c: _Candidate):
        """The chosen token's logprob entry: it, then the top `logprobs` alternatives."""
        k = self.main.sampling_params.logprobs or 0
        top = beam.result
        return self.core._decode_logprobs(TokenLogprobs(
            [c.token] + top.token_ids[1 : k + 1], [c.logprob] + top.logprobs[1 : k + 1], [c.rank] + list(range(1, k + 1)),
        ))

    def _fork(self, chosen: list[_Candidate]) -> None:
        """The next beams: each takes its parent's blocks by reference and is queued to
        compute its one new token (copy-on-write splits the parent's partial last block)."""
        bm = self.core.block_manager
        parents = self.beams
        self.step += 1
        self.beams = []
        for c in chosen:
            parent = parents[c.beam]
            request = self._new_request(parent.request.output_token_ids + [c.token])
            table = bm.get_block_table(parent.request.request_id)
            bm.fork(parent.request.request_id, request.request_id, len(table))
            request.num_computed_tokens = parent.request.num_computed_tokens
            request.block_hashes = list(parent.request.block_hashes)  # the same tokens, the same chain
            request.first_scheduled_time = parent.request.first_scheduled_time
            logprobs = None if parent.logprobs is None else parent.logprobs + [self._entry(parent, c)]
            self.beams.append(_Beam(request, c.cum_logprob, logprobs))
        for parent in parents:
            self._drop(parent.request)
        self.core.scheduler.add_continuations([b.request for b in self.beams])

    def _drop(self, request: Request) -> None:
        """End one beam's request: its blocks go back (those its children share stay). A
        parked one is already out of the queues; one still queued or running leaves them."""
        self.core.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        self.core.block_manager.free(request.request_id)
        self.core.requests.pop(request.request_id, None)

    def _release_beams(self) -> None:
        for beam in self.beams:
            self._drop(beam.request)
        self.beams = []

    def _finish(self, stats: "StepStats | None") -> RequestOutput:
        best = self.hypotheses[0]
        status = RequestStatus.FINISHED_STOPPED if best.stop_token is not None else RequestStatus.FINISHED_LENGTH
        self.main.output_token_ids = list(best.token_ids)  # what the metrics count as generated
        self.main.first_token_time = time.monotonic()  # every beam comes out at the end
        if stats is not None:  # counted as n samples of the prompt would be: the tokens returned
            stats.num_prompt_tokens += self.main.num_prompt_tokens
            stats.num_generation_tokens += sum(len(h.token_ids) for h in self.hypotheses)
        self._end(status, stats)
        p = self.main.sampling_params
        outputs = []
        for i, h in enumerate(self.hypotheses):
            text = self._text(h.token_ids)
            stop_reason = h.stop_token if h.stop_token is not None and h.stop_token in p.stop_token_ids else None
            outputs.append(CompletionOutput(
                index=i, text=text, token_ids=h.token_ids, logprobs=h.logprobs,
                finish_reason="length" if h.stop_token is None else "stop", stop_reason=stop_reason, delta_text=text,
            ))
        root = self.root
        return RequestOutput(
            self.request_id, None, self.main.prompt_token_ids, outputs, finished=True,
            num_cached_tokens=self.main.num_cached_tokens,
            prompt_logprobs=None if root is None else root.prompt_logprobs,
        )

    def _end(self, status: RequestStatus, stats: "StepStats | None") -> None:
        # `main` was never queued: marked finished first, the scheduler has nothing to remove.
        self.main.status = status
        self.core._finish(self.main, status, stats)

    def _text(self, token_ids: list[int]) -> str:
        """The beam's text as a sampled request's would read (special tokens, UTF-8)."""
        p = self.main.sampling_params
        detokenizer = IncrementalDetokenizer(
            self.core.tokenizer, self.main.prompt_token_ids, [],
            include_stop_str_in_output=p.include_stop_str_in_output, skip_special_tokens=p.skip_special_tokens,
        )
        detokenizer.update(token_ids)
        return detokenizer.output_text


def unblock_beam_searches(core: "EngineCore") -> None:
    """Nothing could be scheduled: the free blocks are too few for the next waiting request.
    Parked beams may be what holds them, each search waiting on blocks another holds. One
    search keeps its parked beams and its waiting beams move to the front: the one whose
    beam heads the queue, else the oldest. The others' parked beams are released. A search
    alone always fits the cache (`EngineCore.validate` checks n x its length), so the kept
    one completes its step, and each step of it ends the same way until it finishes."""
    searches = [r.beam_search for r in core.requests.values() if r.beam_search is not None and r.beam_search.main is r]
    if not searches:
        return
    waiting = core.scheduler.waiting
    head = waiting.peek() if waiting else None
    kept = head.beam_search if head is not None and head.beam_search is not None else searches[0]
    for search in searches:
        if search is not kept:
            search.release_parked()
    queued = [b.request for b in kept.beams if b.result is None and not b.request.is_finished
              and b.request.status != RequestStatus.RUNNING]
    core.scheduler.add_continuations(queued, queued=True)

"""Scheduler scenarios without a model: budgets, joins/leaves, chunking, preemption, no leaks.

`_run` plays the engine's part (tokens computed, one token sampled when a request's
tokens are all computed, finish at max_tokens) so the scheduler is tested alone.
"""

import random

import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def _request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), None, max_tokens)


def _scheduler(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=64):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens), bm)


def _run(sched: Scheduler, max_steps=10_000, on_step=None):
    """Drive the scheduler to completion; returns the per-step SchedulerOutputs."""
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return steps
        out = sched.schedule()
        assert not out.is_empty, "unfinished requests but nothing scheduled: deadlock"
        steps.append(out)
        if on_step:
            on_step(sched, out)
        for req, n in zip(out.scheduled, out.num_scheduled_tokens):
            assert n >= 1
            req.num_computed_tokens += n
            assert sched.block_manager.tail_waste(req.request_id, req.num_computed_tokens) <= sched.block_manager.block_size - 1
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(7)
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
        sched.block_manager.check_invariants()
    raise AssertionError("did not finish")


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_all_finish_and_blocks_return(block_size):
    sched = _scheduler(num_blocks=4096 // block_size, block_size=block_size)
    reqs = [_request(f"r{i}", 1 + 37 * i, 5 + i) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    _run(sched)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.num_output_tokens == r.max_tokens for r in reqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_token_budget_and_seq_cap_respected():
    sched = _scheduler(max_num_seqs=3, max_num_batched_tokens=50)
    for i in range(7):
        sched.add_request(_request(f"r{i}", 30, 4))

    def check(s, out):
        assert out.total_num_scheduled_tokens <= 50
        assert len(out.scheduled) <= 3

    _run(sched, on_step=check)


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    sched = _scheduler(max_num_batched_tokens=32)
    sched.add_request(_request("short", 4, 20))
    seen_mixed = []

    def step(s, out):
        if len(out.scheduled) == 1 and out.scheduled[0].request_id == "short" and out.scheduled[0].num_output_tokens == 2:
            s.add_request(_request("long", 100, 2))  # joins mid-flight
        ids = {r.request_id: n for r, n in zip(out.scheduled, out.num_scheduled_tokens)}
        if "short" in ids and "long" in ids and ids["long"] > 1:
            seen_mixed.append(ids)

    _run(sched, on_step=step)
    assert seen_mixed, "the long prompt's chunks never ran in the same step as the decode"
    assert all(ids["short"] == 1 and ids["long"] <= 31 for ids in seen_mixed)


def test_finished_requests_leave_and_waiting_join_the_same_step():
    sched = _scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(_request(f"r{i}", 8, 1 + 2 * (i % 2)))
    joined_after_leave = []

    def step(s, out):
        ids = [r.request_id for r in out.scheduled]
        if "r2" in ids and "r1" in ids:
            joined_after_leave.append(ids)

    _run(sched, on_step=step)
    assert joined_after_leave, "r2 never ran beside r1 after r0 left"


def test_preemption_recomputes_newest_and_everyone_finishes():
    # 6 blocks of 16 = 96 slots; three requests growing to 40 tokens each need 9 blocks.
    sched = _scheduler(num_blocks=6, block_size=16, max_num_batched_tokens=256)
    reqs = [_request(f"r{i}", 20, 20) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    preempted = []
    _run(sched, on_step=lambda s, out: preempted.extend(r.request_id for r in out.preempted))
    assert preempted and "r0" not in preempted  # the oldest always progresses
    assert sched.num_preemptions == len(preempted)
    assert all(r.num_output_tokens == 20 for r in reqs)
    assert sched.block_manager.num_free_blocks == 6


def test_request_preempting_itself_when_alone_with_older():
    sched = _scheduler(num_blocks=3, block_size=16)
    a, b = _request("a", 16, 17), _request("b", 15, 2)
    sched.add_request(a)
    sched.add_request(b)
    _run(sched)
    assert a.num_output_tokens == 17 and b.num_output_tokens == 2


def test_finish_of_waiting_request_removes_it():
    sched = _scheduler(max_num_seqs=1)
    a, b = _request("a", 4, 3), _request("b", 4, 3)
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)  # idempotent
    assert list(sched.waiting) == [] and sched.running == [a]
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_under_memory_pressure(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 16, 32])
    num_blocks = 512 // block_size
    sched = _scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=rng.randint(1, 8),
                       max_num_batched_tokens=rng.randint(8, 128))
    reqs = []
    for i in range(20):
        prompt, out = rng.randint(1, 200), rng.randint(1, 60)
        reqs.append(_request(f"r{i}", prompt, out))
        sched.add_request(reqs[-1])
    aborted = set()

    def maybe_abort(s, out):
        if rng.random() < 0.02:
            victims = [r for r in s.running if r.request_id not in aborted]
            if victims:
                v = rng.choice(victims)
                aborted.add(v.request_id)
                s.finish(v, RequestStatus.FINISHED_ABORTED)

    # Requests finished between schedule() and update must not be updated: filter them.
    steps = 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 20_000
        out = sched.schedule()
        assert not out.is_empty
        maybe_abort(sched, out)
        for req, n in zip(out.scheduled, out.num_scheduled_tokens):
            if req.is_finished:
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(7)
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
        sched.block_manager.check_invariants()
    for r in reqs:
        assert r.is_finished
        if r.request_id not in aborted:
            assert r.num_output_tokens == r.max_tokens
    assert sched.block_manager.num_free_blocks == num_blocks


def test_prefill_chunk_cap_shrinks_with_context_and_decodes_keep_running():
    """With a context weight w, a long prompt's chunks shrink by w / (w + context) (down to
    MIN_PREFILL_CHUNK), so steps late in a long prefill cost about what early ones do; a
    decoding request beside it is scheduled every step."""
    from engine.scheduler import MIN_PREFILL_CHUNK

    bm = BlockManager(2048, 16)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, long_prefill_token_threshold=512)
    sched = Scheduler(config, bm, prefill_context_weight=1000)
    decoding = _request("decode", 8, 400)
    long = _request("long", 6000, 1)
    sched.add_request(decoding)
    chunks = []

    def record(s, out):
        if decoding.num_computed_tokens >= 8 and long.status != RequestStatus.WAITING:
            assert decoding in out.scheduled or decoding.status != RequestStatus.RUNNING
        for req, n in zip(out.scheduled, out.num_scheduled_tokens):
            if req is long and req.num_computed_tokens < req.num_prompt_tokens:
                chunks.append((req.num_computed_tokens, n))

    sched.schedule()  # the short prompt first
    decoding.num_computed_tokens = 8
    decoding.output_token_ids.append(7)
    sched.add_request(long)
    _run(sched, on_step=record)
    assert sum(n for _, n in chunks) == 6000
    assert chunks[0] == (0, 512)
    for context, n in chunks:
        assert n == min(6000 - context, max(MIN_PREFILL_CHUNK, 512 * 1000 // (1000 + context)))
    assert chunks[-2][1] < 100  # late chunks are a fraction of the first


def test_prefill_chunk_cap_is_the_threshold_without_a_context_weight():
    bm = BlockManager(1024, 16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, long_prefill_token_threshold=300), bm)
    long = _request("long", 1000, 1)
    sched.add_request(long)
    sizes = []
    _run(sched, on_step=lambda s, out: sizes.extend(n for r, n in zip(out.scheduled, out.num_scheduled_tokens) if n > 1))
    assert sizes == [300, 300, 300, 100]

"""The waiting queue's order between tenants and priorities (engine/fair_queue.py), alone and
inside the scheduler: who is admitted first, who is preempted, and that untagged requests
keep the plain arrival order. No model: the scheduler is driven as in test_scheduler.py."""

import random

import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.fair_queue import FairQueue
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def _request(rid: str, tenant=None, priority=0, prompt_len=4, max_tokens=4, arrival=None) -> Request:
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), None, max_tokens)
    r.tenant, r.priority = tenant, priority
    if arrival is not None:
        r.arrival_time = arrival
    return r


def _scheduler(policy="fair", num_blocks=256, max_num_seqs=8, max_num_batched_tokens=256):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             scheduling_policy=policy)
    return Scheduler(config, BlockManager(num_blocks, 16))


def _step(sched: Scheduler):
    """One step, playing the engine: computed tokens advance, a token is sampled when all
    are computed, requests finish at max_tokens."""
    out = sched.schedule()
    for req, n in zip(out.scheduled, out.num_scheduled_tokens):
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(7)
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    sched.block_manager.check_invariants()
    return out


def _drain(q: FairQueue) -> list[str]:
    return [q.popleft().request_id for _ in range(len(q))]


# ---- the queue alone ----------------------------------------------------------------------------
def test_untagged_requests_keep_deque_semantics():
    q = FairQueue()
    reqs = [_request(f"r{i}") for i in range(5)]
    for r in reqs:
        q.append(r)
    q.remove(reqs[2])
    first = q.popleft()
    q.appendleft(first)  # put back: first again
    q.remove(reqs[3])
    q.remove(reqs[4])
    q.extendleft(reversed([reqs[4], reqs[3]]))  # parked requests go back in front, in order
    assert len(q) == 4 and bool(q)
    assert [r.request_id for r in q] == ["r4", "r3", "r0", "r1"]
    assert _drain(q) == ["r4", "r3", "r0", "r1"]
    assert not q and len(q) == 0
    with pytest.raises(IndexError):
        q.popleft()


def test_priority_first_then_least_used_tenant_then_arrival():
    clock = [0.0]
    q = FairQueue(clock=lambda: clock[0])
    for i in range(3):
        q.append(_request(f"a{i}", tenant="a"))
    q.append(_request("b0", tenant="b"))
    q.append(_request("urgent", tenant="a", priority=-1))
    q.append(_request("lazy", tenant="c", priority=5))
    q.charge("a", 100)  # a has used the engine; b has not
    assert q.popleft().request_id == "urgent"  # priority beats fairness
    assert q.popleft().request_id == "b0"  # then the tenant with the least use
    assert [q.popleft().request_id for _ in range(3)] == ["a0", "a1", "a2"]  # arrival within a tenant
    assert q.popleft().request_id == "lazy"


def test_tenants_interleave_as_they_are_charged():
    q = FairQueue()
    for i in range(3):
        q.append(_request(f"a{i}", tenant="a"))
    for i in range(3):
        q.append(_request(f"b{i}", tenant="b"))
    order = []
    while q:
        r = q.popleft()
        order.append(r.request_id)
        q.charge(r.tenant, 10)
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_usage_decays_with_its_half_life():
    clock = [0.0]
    q = FairQueue(clock=lambda: clock[0], half_life_s=10.0)
    q.charge("a", 1000)
    clock[0] = 10.0
    assert q.usage("a") == pytest.approx(500)
    clock[0] = 30.0
    assert q.usage("a") == pytest.approx(125)


def test_fcfs_ignores_tenants_and_priorities():
    q = FairQueue(enabled=False)
    q.append(_request("a0", tenant="a"))
    q.append(_request("b0", tenant="b", priority=-5))
    q.charge("a", 1000)
    assert _drain(q) == ["a0", "b0"]


# ---- in the scheduler ---------------------------------------------------------------------------
def _flood_then_one(policy: str) -> tuple[Scheduler, Request]:
    """Tenant a fills every slot and queues 16 more; then b sends one request."""
    sched = _scheduler(policy, max_num_seqs=4)
    for i in range(20):
        sched.add_request(_request(f"a{i}", tenant="a", max_tokens=30))
    for _ in range(3):
        _step(sched)
    b = _request("b0", tenant="b", max_tokens=30)
    sched.add_request(b)
    return sched, b


def test_a_second_tenant_gets_a_slot_at_once_under_fair():
    sched, b = _flood_then_one("fair")
    out = _step(sched)
    assert b in out.scheduled, "b should preempt one of a's 4 slots (a runs above its share of 2)"
    assert [r.tenant for r in out.preempted] == ["a"]
    victim = out.preempted[0]
    assert victim.request_id == "a3", "the victim is a's newest running request"
    assert len(sched.running) == 4
    # a keeps its other slots: shares settle, nothing swaps back
    for _ in range(5):
        out = _step(sched)
        assert not out.preempted
    assert b in sched.running


def test_fcfs_makes_the_second_tenant_wait_behind_the_flood():
    sched, b = _flood_then_one("fcfs")
    for _ in range(20):
        out = _step(sched)
        assert not out.preempted
        assert b not in out.scheduled


def test_untagged_requests_are_never_preempted_for_fairness():
    sched = _scheduler("fair", max_num_seqs=2)
    for i in range(6):
        sched.add_request(_request(f"r{i}", max_tokens=3))
    admitted = []
    while sched.has_unfinished_requests():
        out = _step(sched)
        assert not out.preempted
        admitted += [r.request_id for r in out.scheduled if r.request_id not in admitted]
    assert admitted == [f"r{i}" for i in range(6)]  # arrival order, as before


def test_priority_preempts_a_less_urgent_running_request():
    sched = _scheduler("fair", max_num_seqs=2)
    sched.add_request(_request("low0", tenant="a", priority=1, max_tokens=20))
    sched.add_request(_request("low1", tenant="a", priority=1, max_tokens=20))
    _step(sched)
    urgent = _request("urgent", tenant="a", priority=0, max_tokens=2)
    sched.add_request(urgent)
    out = _step(sched)
    assert urgent in out.scheduled and [r.request_id for r in out.preempted] == ["low1"]


def test_memory_preemption_takes_the_heaviest_tenants_request():
    # 3 requests need 3 blocks each as they grow; 8 blocks of 4 tokens cannot hold them all.
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockManager(8, 4))
    light = _request("light", tenant="light", prompt_len=4, max_tokens=12, arrival=1.0)
    heavy = [_request(f"heavy{i}", tenant="heavy", prompt_len=4, max_tokens=12, arrival=0.0) for i in range(2)]
    for r in heavy:
        sched.add_request(r)
    sched.waiting.charge("heavy", 1000)
    sched.add_request(light)
    preempted = []
    while sched.has_unfinished_requests():
        out = _step(sched)
        preempted += out.preempted
    assert preempted and all(r.tenant == "heavy" for r in preempted), [r.request_id for r in preempted]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("seed", range(4))
def test_random_tenants_all_finish_and_blocks_return(seed):
    rng = random.Random(seed)
    sched = _scheduler("fair", num_blocks=24, max_num_seqs=rng.choice([2, 3, 4]), max_num_batched_tokens=48)
    reqs = []
    for step in range(400):
        if step < 60 and rng.random() < 0.5:
            r = _request(f"r{step}", tenant=rng.choice(["a", "b", "c", None]), priority=rng.choice([0, 0, 1]),
                         prompt_len=rng.randint(1, 40), max_tokens=rng.randint(1, 12))
            reqs.append(r)
            sched.add_request(r)
        if not sched.has_unfinished_requests():
            continue
        out = _step(sched)
        assert not out.is_empty, "unfinished requests but nothing scheduled"
        assert len(sched.running) <= sched.config.max_num_seqs
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks

"""The statistics the scheduler and the KV manager keep as requests move equal a recount.

stats() reads counts kept on events (added, admitted, preempted, finished, aborted) rather
than recounting requests every step; here each is recounted the slow way, over the requests,
after every step of a run with preemptions and aborts (waiting, paused and running ones).
"""

from __future__ import annotations

import itertools
import random

import pytest

from engine_helpers import VOCAB, make_engine, make_hf_model
from trtprompt.engine.engine import LLMEngine, kv_fragmentation
from trtprompt.engine.request import RequestStatus, SamplingParams


STATES = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama")


def recount(engine: LLMEngine) -> dict[str, object]:
    """Every kept count, computed from the requests and block tables alone."""
    sched, kv = engine.scheduler, engine.kv
    live = list(engine.requests.values())
    running = [r for r in live if r.status is RequestStatus.RUNNING]
    held = {rid: len(table) for rid, table in kv.block_tables.items()}
    return {
        "waiting": sum(1 for r in sched.waiting if not r.is_finished),
        "paused": sum(1 for r in sched.waiting if r.stats.num_preemptions and not r.is_finished),
        "running": sorted(r.request_id for r in running),
        "outstanding": sum(r.reserved_blocks - held.get(r.request_id, 0) for r in running),
        "held_blocks": sum(held.values()),
        "empty_slots": sum(held.get(r.request_id, 0) * kv.tokens_per_block - r.num_computed_tokens for r in live),
        "fragmentation": kv_fragmentation(kv, live, sched.guaranteed),
    }


def kept(engine: LLMEngine) -> dict[str, object]:
    sched, kv, stats = engine.scheduler, engine.kv, engine.stats()
    assert stats.paused_requests == sched.num_paused and stats.waiting_requests == sched.num_waiting
    return {
        "waiting": sched.num_waiting,
        "paused": sched.num_paused,
        "running": sorted(r.request_id for r in sched.running),
        "outstanding": sched.outstanding_reservations,
        "held_blocks": kv.num_held_blocks,
        "empty_slots": kv.num_empty_slots,
        "fragmentation": stats.fragmentation,
    }


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_kept_counts_equal_a_recount_through_preemption_and_aborts(llama, policy):
    rng = random.Random(7)
    engine = make_engine(llama, policy=policy, kv_tokens=96, max_num_tokens=64, max_batch_size=6)
    prefix = [rng.randrange(3, VOCAB) for _ in range(16)]  # shared: blocks reused across requests
    pending = [(f"r{i}", prefix[:rng.choice([0, 8, 16])] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 20))],
                rng.randint(8, 30))
               for i in range(16)]
    aborted: list[RequestStatus] = []
    states = itertools.cycle(STATES)
    for _ in range(5000):
        for _ in range(rng.randint(0, 2)):
            if pending:
                rid, prompt, n = pending.pop()
                engine.add_request(rid, prompt, SamplingParams(max_tokens=n))
        if rng.random() < 0.08:
            # Each state in turn, where a request is in it: aborts reach waiting, running and paused ones.
            state = next(states)
            victims = [r for r in engine.requests.values() if r.status is state]
            if victims:
                victim = rng.choice(victims)
                aborted.append(victim.status)
                engine.abort(victim.request_id)
        assert kept(engine) == recount(engine)  # between an abort and the step that flushes it too
        engine.step()
        assert kept(engine) == recount(engine)
        if not pending and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert kept(engine) == recount(engine)
    assert engine.kv.num_held_blocks == 0 and engine.kv.num_computed_held == 0
    # The run went through what the counts must follow.
    assert {RequestStatus.WAITING, RequestStatus.RUNNING} <= set(aborted)
    if policy == "max_utilization":
        assert engine.stats().preemptions > 0 and RequestStatus.PREEMPTED in aborted

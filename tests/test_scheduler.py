"""The scheduler as a spec: one test per rule of engine/scheduler.py.

The scheduler runs against FakeKV, a small in-test stand-in for
KVCacheManager that keeps only what the scheduler asks of it (a free-block
count, per-request block counts, which prefixes are cached or being
computed), so each rule is shown without a model, a block pool or hashing.
The real manager is covered by test_block_pool.py and the engine tests.
"""

from __future__ import annotations

from trtprompt.engine.config import SchedulerConfig
from trtprompt.engine.request import Request, RequestStatus, SamplingParams
from trtprompt.engine.scheduler import Scheduler, SchedulerOutput

TPB = 4  # tokens per block


class FakeKV:
    """Block accounting only: a request's table is a list of flags (True: a block it owns)."""

    def __init__(self, num_blocks: int) -> None:
        self.tokens_per_block = TPB
        self.num_free_blocks = num_blocks
        self.block_tables: dict[str, list[bool]] = {}
        self.cached: dict[str, int] = {}  # request id -> leading prompt blocks found in the cache
        self.in_flight: set[str] = set()  # request ids whose next prompt block another request computes

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // TPB)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(t) for t in self.block_tables.values())

    def find_prefix(self, req: Request) -> list[object]:
        return [object()] * self.cached.get(req.request_id, 0)

    def next_block_in_flight(self, req: Request, num_hits: int) -> bool:
        return req.request_id in self.in_flight

    def free_blocks_needed(self, hits: list[object], num_new_blocks: int) -> int:
        return num_new_blocks  # cached blocks here are always shared, never revived from the free queue

    def allocate(self, req: Request, num_new_tokens: int, hits: list[object] | None = None) -> bool:
        table = self.block_tables.get(req.request_id, [])
        hits = hits or []
        computed = req.num_computed_tokens + len(hits) * TPB
        n_new = max(self.blocks_for(computed + num_new_tokens) - len(table) - len(hits), 0)
        if n_new > self.num_free_blocks:
            return False
        req.num_computed_tokens = computed
        self.num_free_blocks -= n_new
        self.block_tables[req.request_id] = table + [False] * len(hits) + [True] * n_new
        return True

    def free(self, req: Request) -> None:
        self.num_free_blocks += sum(self.block_tables.pop(req.request_id, []))

    def record_lookup(self, req: Request, num_hits: int) -> None:
        pass

    def mark_in_flight(self, req: Request, num_hits: int) -> None:
        pass


def make(num_blocks: int = 64, max_num_tokens: int = 64, chunked: bool = False,
         policy: str = "max_utilization", max_batch_size: int = 8) -> tuple[Scheduler, FakeKV]:
    kv = FakeKV(num_blocks)
    cfg = SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_seq_len=256,
                          enable_chunked_context=chunked, batch_scheduler_policy=policy)
    return Scheduler(cfg, kv), kv  # type: ignore[arg-type]  # FakeKV stands in for KVCacheManager


def request(sched: Scheduler, rid: str, prompt_len: int, max_output: int = 8) -> Request:
    req = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_output), max_output,
                  frozenset(), None, 0)
    sched.add(req)
    return req


def run(out: SchedulerOutput) -> None:
    """What the engine does with a step: the scheduled tokens are computed, each finished context samples."""
    for s in out.scheduled:
        s.request.num_computed_tokens = s.context_len + s.num_new_tokens
        if s.samples:
            s.request.append_token(7)


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(s.request.request_id, s.num_new_tokens, s.is_context) for s in out.scheduled]


def test_context_chunks_are_whole_blocks_except_the_last() -> None:
    sched, _ = make(max_num_tokens=10, chunked=True)
    request(sched, "a", 21)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks += [n for _, n, _ in plan(out)]
        run(out)
    # A budget of 10 tokens gives 8-token chunks (2 blocks); the last 5 tokens fit whole.
    assert chunks == [8, 8, 5]


def test_without_chunked_context_a_prompt_over_the_budget_is_not_split() -> None:
    sched, _ = make(max_num_tokens=10)
    request(sched, "a", 21)
    assert sched.schedule().scheduled == []


def test_generation_goes_before_context() -> None:
    sched, _ = make(max_num_tokens=22, chunked=True)
    request(sched, "b", 60)  # admitted first: running order is [b, a]
    request(sched, "a", 2)
    first = sched.schedule()
    assert plan(first) == [("b", 20, True), ("a", 2, True)]
    run(first)  # a sampled its first token and now generates; b is still in its prompt
    # a's one token comes first; b's chunk is cut from what is left (21 -> 20 tokens, 5 blocks).
    assert plan(sched.schedule()) == [("a", 1, False), ("b", 20, True)]


def test_first_come_first_served_without_overtaking() -> None:
    sched, _ = make(num_blocks=2)
    request(sched, "big", 12)  # needs 3 blocks, only 2 exist free
    request(sched, "small", 3)  # would fit, but arrived later
    assert sched.schedule().scheduled == []
    assert [r.request_id for r in sched.waiting] == ["big", "small"]


def test_the_newest_running_request_is_preempted_and_requeued_first() -> None:
    sched, kv = make(num_blocks=2)
    a, b = request(sched, "a", 4), request(sched, "b", 4)
    first = sched.schedule()
    assert plan(first) == [("a", 4, True), ("b", 4, True)]
    run(first)  # each now holds 5 tokens in 1 block: the next token needs a second block
    out = sched.schedule()
    assert plan(out) == [("a", 1, False)]  # a took b's block
    assert list(sched.waiting) == [b] and list(sched.running) == [a]
    assert (b.status, b.num_computed_tokens, b.stats.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert "b" not in kv.block_tables and sched.num_preemptions == 1


def test_guaranteed_no_evict_reserves_blocks_for_the_whole_output() -> None:
    sched, kv = make(num_blocks=4, policy="guaranteed_no_evict")
    a = request(sched, "a", 4, max_output=8)  # 12 tokens: reserves 3 blocks, holds 1 now
    request(sched, "b", 4, max_output=4)  # 8 tokens: 2 blocks; 3 are free but 2 are a's
    assert plan(sched.schedule()) == [("a", 4, True)]
    assert kv.num_free_blocks == 3 and a.reserved_blocks == 3
    assert [r.request_id for r in sched.waiting] == ["b"]
    sched.finish(a)
    assert plan(sched.schedule()) == [("b", 4, True)]


def test_a_prefix_block_being_computed_makes_the_next_request_wait_a_step() -> None:
    sched, kv = make()
    kv.in_flight.add("b")  # a running request is computing b's next prompt block
    request(sched, "b", 12)
    request(sched, "c", 4)  # behind b: FCFS holds it too
    assert sched.schedule().scheduled == []
    kv.in_flight.clear()  # that block is computed and cached now
    kv.cached["b"] = 2
    assert plan(sched.schedule()) == [("b", 4, True), ("c", 4, True)]

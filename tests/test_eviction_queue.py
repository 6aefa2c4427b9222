"""The free-block queues of every eviction policy: each block in exactly one place, kept counts equal
a recount, and the lru policy's victims equal a plain-list reference of prioritized LRU."""

from __future__ import annotations

import random

import pytest

from trtprompt.engine.block_pool import Block, BlockPool
from trtprompt.engine.eviction import DEFAULT_PRIORITY, FREQ_CAP, FreeBlockQueue
from trtprompt.knobs import EVICTION_POLICIES


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def check_invariants(pool: BlockPool) -> None:
    """Every block is held (ref_cnt > 0, in no queue) or free in exactly one queue; counts are recounts."""
    fb = pool.free_blocks
    seen: dict[int, FreeBlockQueue] = {}
    cached = 0
    nonempty = 0
    for q in fb.queues():
        members = list(q)
        assert len(members) == q.size
        for b in members:
            assert b.block_id not in seen, f"block {b.block_id} in two queues"
            assert b.queue is q and b.ref_cnt == 0
            seen[b.block_id] = q
            if q.level is None:
                assert b.block_hash is None
            else:
                assert b.block_hash is not None and q.level == b.priority
                cached += 1
                nonempty |= 1 << q.level
    for b in pool.blocks:
        if b.block_id not in seen:
            assert b.ref_cnt > 0 and b.queue is None and b.prev is None and b.next is None
        assert 0 <= b.freq <= FREQ_CAP
    assert fb.num_cached == cached == pool.num_cached_free
    assert pool.num_free_blocks == len(seen)
    assert fb._nonempty == nonempty
    for h, b in pool.cached.items():
        assert b.block_hash == h
    assert len(fb._expiring) <= pool.num_blocks and fb.ghost_size() <= pool.num_blocks


def random_ops(pool: BlockPool, clock: FakeClock, rng: random.Random, steps: int) -> list[list[int]]:
    """Random allocate / publish / hit / free / retention / time steps; returns each allocation's block ids."""
    held: list[Block] = []
    allocations: list[list[int]] = []
    next_hash = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.3 and pool.num_free_blocks:
            got = pool.allocate(rng.randint(1, min(4, pool.num_free_blocks)))
            allocations.append([b.block_id for b in got])
            held.extend(got)
        elif op < 0.45 and held:
            b = rng.choice(held)
            next_hash += 1
            pool.cache(b, next_hash.to_bytes(16, "little"))
        elif op < 0.6 and pool.cached:
            h = rng.choice(sorted(pool.cached))
            b = pool.lookup(h)
            assert b is not None
            pool.touch([b])
            held.append(b)
        elif op < 0.65 and held:
            pool.set_retention(rng.choice(held), rng.choice((0, 35, 60, 100)), rng.choice((None, 500, 2000)))
        elif op < 0.7:
            clock.now += rng.random()
        elif held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            pool.free(held[:k])
            del held[:k]
        check_invariants(pool)
    return allocations


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_every_block_is_in_one_place_and_counts_equal_a_recount(policy: str) -> None:
    clock = FakeClock()
    pool = BlockPool(24, True, policy, clock=clock)
    check_invariants(pool)
    random_ops(pool, clock, random.Random(7), 3000)
    assert pool.evicted_blocks > 100  # the run did evict, through every queue


def test_lru_victims_equal_a_reference_of_prioritized_lru() -> None:
    """Replay random operations; at each allocation a plain-list reference (O(n), obviously right) picks
    the victim: a hash-less block first (the most recently freed), else the lowest priority, least
    recently freed. A priority whose duration ran out reverts at the next allocation, and the block
    then counts as released at that moment (it joins the back of the default level, in expiry order)."""
    clock = FakeClock()
    pool = BlockPool(16, True, "lru", clock=clock)
    # block id -> (release seq, expiry); the pool starts with block 0 at the front of the hash-less queue
    release: dict[int, tuple[int, float | None]] = {b.block_id: (-b.block_id, None) for b in pool.blocks}
    seq = 0
    fb = pool.free_blocks
    original_add, original_pop = fb.add, fb.pop

    def add(block: Block) -> None:
        nonlocal seq
        seq += 1
        timed = block.block_hash is not None and block.priority != DEFAULT_PRIORITY and block.duration_s is not None
        release[block.block_id] = (seq, clock() + block.duration_s if timed and block.duration_s else None)
        original_add(block)

    def pop() -> Block:
        nonlocal seq
        free = [b for b in pool.blocks if b.queue is not None]
        expired = [b for b in free if release[b.block_id][1] is not None and release[b.block_id][1] <= clock()]
        for b in sorted(expired, key=lambda b: release[b.block_id][::-1]):
            seq += 1
            release[b.block_id] = (seq, None)
        empty = [b for b in free if b.block_hash is None]
        if empty:
            want = max(empty, key=lambda b: release[b.block_id][0])
        else:
            want = min(free, key=lambda b: (DEFAULT_PRIORITY if b in expired else b.priority, release[b.block_id][0]))
        got = original_pop()
        assert got is want, (got, want)
        return got

    fb.add = add  # type: ignore[method-assign]
    fb.pop = pop  # type: ignore[method-assign]
    random_ops(pool, clock, random.Random(3), 2000)
    assert pool.evicted_blocks > 50


def test_s3fifo_second_chance_keeps_the_block_hit_most() -> None:
    """Main-queue blocks: one more pass per remembered hit, so the most-hit block is evicted last."""
    pool = BlockPool(4, True, "s3fifo")
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache(b, bytes([i]) * 16)
    for hits, b in zip((1, 3, 2, 1), blocks):
        for _ in range(hits):
            pool.touch([b])
            pool.free([b])  # a hit block goes to the main queue
    pool.free(blocks)
    evicted = [pool.allocate(1)[0].block_id for _ in range(4)]
    assert evicted == [0, 3, 2, 1]


def test_2q_and_s3fifo_send_a_recomputed_ghost_to_the_main_queue() -> None:
    for policy in ("2q", "s3fifo"):
        pool = BlockPool(20, True, policy)  # small FIFO: 2 blocks
        blocks = pool.allocate(20)
        for i, b in enumerate(blocks):
            pool.cache(b, bytes([i]) * 16)
        pool.free(blocks)
        assert pool.free_blocks._main[DEFAULT_PRIORITY].size == 0
        (first,) = pool.allocate(1)  # evicted from the small FIFO: its hash is remembered
        assert first.block_id == 0 and pool.free_blocks.ghost_size() == 1
        pool.cache(first, bytes([0]) * 16)  # the same content computed again
        pool.free([first])
        assert first.queue is pool.free_blocks._main[DEFAULT_PRIORITY]
        assert pool.free_blocks.ghost_size() == 0


def test_unknown_policy_is_refused_naming_the_knob() -> None:
    with pytest.raises(ValueError, match="kv_cache_eviction_policy must be one of lru, 2q, s3fifo, got 'fifo'"):
        BlockPool(4, True, "fifo")

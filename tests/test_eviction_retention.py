"""Retention priorities (TensorRT-LLM's KvCacheRetentionConfig): per-block priorities from token ranges,
lower priorities evicted first under every policy, durations that revert to the default."""

from __future__ import annotations

import pytest
from engine_helpers import serve_alone

from trtprompt.engine.block_pool import BlockPool
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.request import Request, RetentionConfig, SamplingParams, TokenRangeRetention
from trtprompt.error_codes import FieldError
from trtprompt.knobs import EVICTION_POLICIES

SYSTEM = [7, 7, 8, 8]  # two full blocks of 2 tokens


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_kv(policy: str, clock: FakeClock | None = None) -> KVCacheManager:
    kv = KVCacheManager(12, 2, True, policy)
    if clock is not None:
        kv.pool = BlockPool(12, True, policy, clock=clock)
    return kv


def flood(kv: KVCacheManager, n: int, blocks: int = 9) -> None:
    for k in range(n):
        serve_alone(kv, f"flood{k}", [5000 + 1000 * k + i for i in range(2 * blocks - 1)])


PIN = RetentionConfig((TokenRangeRetention(0, 4, 100),))


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_pinned_system_prompt_survives_a_flood_that_evicts_everything_else(policy: str) -> None:
    kv = make_kv(policy)
    serve_alone(kv, "pin", SYSTEM + [1], PIN)
    serve_alone(kv, "other", [9, 9, 10, 10, 3])  # the same shape at the default priority
    flood(kv, 6)  # 6 x 8 cached blocks: 4x the pool
    assert serve_alone(kv, "pinned-again", SYSTEM + [2]) == 2
    assert serve_alone(kv, "other-again", [9, 9, 10, 10, 4]) == 0
    # Everything but the pinned blocks and the last flood request's was evicted.
    cached = {b.block_id for b in kv.pool.cached.values()}
    assert len(cached) == 2 + 8 + 1  # pinned, last flood prompt, other-again's block [9, 9]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_higher_priority_is_evicted_later_not_never(policy: str) -> None:
    kv = make_kv(policy)
    serve_alone(kv, "pin", SYSTEM + [1], PIN)
    serve_alone(kv, "big", list(range(3000, 3023)))  # 12 blocks: the whole pool, pinned ones included
    assert serve_alone(kv, "pinned-again", SYSTEM + [2]) == 0


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_an_expired_duration_reverts_to_the_default(policy: str) -> None:
    clock = FakeClock()
    timed = RetentionConfig((TokenRangeRetention(0, 4, 100, duration_ms=1000),))
    kv = make_kv(policy, clock)
    serve_alone(kv, "pin", SYSTEM + [1], timed)
    clock.now += 0.5  # within the duration: still pinned
    flood(kv, 3)
    assert serve_alone(kv, "within", SYSTEM + [2]) == 2  # its release restarts the duration
    pinned = [kv.pool.lookup(h) for h in _hashes(kv, SYSTEM + [0])]
    assert [b.priority if b else None for b in pinned] == [100, 100]
    clock.now += 1.5  # past the duration since that release
    flood(kv, 3)
    assert [b.priority if b else None for b in pinned] == [35, 35]
    if policy == "lru":
        assert serve_alone(kv, "expired", SYSTEM + [3]) == 0  # evicted as any default block
    else:
        assert serve_alone(kv, "expired", SYSTEM + [3]) == 2  # hit before: the main queue keeps it from the scan


def _hashes(kv: KVCacheManager, tokens: list[int]) -> list[bytes]:
    req = Request("h", tokens, SamplingParams(), 1, frozenset(), None, 0)
    kv.find_prefix(req)
    return req.block_hashes


def test_the_priority_of_each_block_follows_the_range_holding_its_first_token() -> None:
    """TensorRT-LLM's own cases (its KvCacheRetentionConfig tests): 80, 50, unset, unset; 80, 80, 30, 30."""
    a = RetentionConfig((TokenRangeRetention(0, 64, 80), TokenRangeRetention(64, 128, 50)), decode_priority=30)
    assert [a.for_block(i, 64, 256) for i in range(4)] == [(80, None), (50, None), None, None]
    b = RetentionConfig((TokenRangeRetention(63, 127, 30), TokenRangeRetention(0, 63, 80)), decode_priority=30)
    assert [a_[0] if a_ else None for a_ in (b.for_block(i, 32, 127) for i in range(4))] == [80, 80, 30, 30]
    assert b.token_ranges[0].token_start == 0  # kept sorted
    # Past the prompt: the decode priority and duration.
    c = RetentionConfig((TokenRangeRetention(0, None, 90, 500),), decode_priority=10, decode_duration_ms=2000)
    assert [c.for_block(i, 4, 8) for i in range(4)] == [(90, 500), (90, 500), (10, 2000), (10, 2000)]


def test_decode_blocks_take_the_decode_priority() -> None:
    kv = make_kv("lru")
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), 4, frozenset(), None, 0,
                  retention=RetentionConfig(decode_priority=80))
    assert kv.allocate(req, 3)
    req.num_computed_tokens = 3
    for t in (4, 5, 6):
        assert kv.allocate(req, 1)
        req.append_token(t)
        req.num_computed_tokens += 1
    table = kv.block_tables["r"]
    assert [b.priority for b in table] == [35, 35, 80]  # block 1 starts at token 2, inside the prompt


@pytest.mark.parametrize("make,field", [
    (lambda: TokenRangeRetention(0, 4, 101), "token_ranges.priority"),
    (lambda: TokenRangeRetention(0, 4, -1), "token_ranges.priority"),
    (lambda: TokenRangeRetention(-1, 4, 50), "token_ranges.token_start"),
    (lambda: TokenRangeRetention(4, 4, 50), "token_ranges.token_end"),
    (lambda: TokenRangeRetention(0, 4, 50, duration_ms=0), "token_ranges.duration_ms"),
    (lambda: RetentionConfig((TokenRangeRetention(0, 64, 80), TokenRangeRetention(30, 128, 80))), "token_ranges"),
    (lambda: RetentionConfig((TokenRangeRetention(0, None, 80), TokenRangeRetention(30, 128, 80))), "token_ranges"),
    (lambda: RetentionConfig(decode_priority=200), "decode_priority"),
    (lambda: RetentionConfig(decode_duration_ms=-5), "decode_duration_ms"),
])
def test_bad_retention_names_the_field(make, field: str) -> None:
    with pytest.raises(FieldError) as err:
        make()
    assert err.value.field == field and str(err.value).startswith(field + " ")

"""A scan of one-off prompts against hot prefixes, at pool level with exact hit counts (docs/prefix-pool.md,
"Eviction"), and the benchmark's workload figures the docs quote."""

from __future__ import annotations

import pytest
from engine_helpers import serve_alone

from trtprompt.bench.eviction_sim import ScanWorkload, make_requests, run_pool
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.knobs import EVICTION_POLICIES

SYSTEM = [7, 7, 8, 8]  # two full blocks of 2 tokens


def one_off(n: int) -> list[int]:
    return [1000 + 100 * n + i for i in range(17)]  # 8 full blocks + 1 token: 9 blocks of the 12


@pytest.mark.parametrize("policy,hot_hits", [("lru", [2, 0, 0]), ("2q", [2, 2, 2]), ("s3fifo", [2, 2, 2])])
def test_two_one_offs_between_hot_requests(policy: str, hot_hits: list[int]) -> None:
    """Pool of 12 blocks of 2 tokens. A, A, S1, S2, A, S3, S4, A: each pair of one-off prompts
    (18 blocks) overflows what the pool has free beside A's 2 blocks.

    lru: S2 evicts A's blocks (the least recently freed), and S4 again. 2q / s3fifo: A's blocks,
    hit once, live in the main queue; the one-off blocks, never hit, cycle through the small
    FIFO (1 block here) and are the ones evicted."""
    kv = KVCacheManager(12, 2, True, policy)
    got = [serve_alone(kv, "a1", SYSTEM + [1])]
    assert got == [0]
    got = []
    got.append(serve_alone(kv, "a2", SYSTEM + [2]))
    serve_alone(kv, "s1", one_off(1))
    serve_alone(kv, "s2", one_off(2))
    got.append(serve_alone(kv, "a3", SYSTEM + [3]))
    serve_alone(kv, "s3", one_off(3))
    serve_alone(kv, "s4", one_off(4))
    got.append(serve_alone(kv, "a4", SYSTEM + [4]))
    assert got == hot_hits
    # Without the one-off prompts every policy hits every time.
    kv = KVCacheManager(12, 2, True, policy)
    assert [serve_alone(kv, f"b{i}", SYSTEM + [i]) for i in range(4)] == [0, 2, 2, 2]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_one_off_prompt_is_never_hit_again(policy: str) -> None:
    kv = KVCacheManager(12, 2, True, policy)
    serve_alone(kv, "s1", one_off(1))
    assert serve_alone(kv, "s1-again", one_off(1)) == 8  # still cached: nothing needed its blocks


def test_scan_workload_figures() -> None:
    """The benchmark's default workload (seed 0, 2 in flight): exact hot-prefix hits per policy.

    48 measured hot requests x 4 system blocks = 192 asked for; without the one-off prompts all are hit;
    with them, lru keeps 156 (0.81), 2q and s3fifo all 192."""
    w = ScanWorkload()
    assert (w.num_one_off, w.num_hot_requests) == (12, 48)
    base = {p: run_pool(w, make_requests(w, False), p, 2) for p in EVICTION_POLICIES}
    scan = {p: run_pool(w, make_requests(w, True), p, 2) for p in EVICTION_POLICIES}
    assert {p: (c.hot_hits, c.hot_queried) for p, c in base.items()} == {p: (192, 192) for p in EVICTION_POLICIES}
    hot = {p: c.hot_hits for p, c in scan.items()}
    assert hot == {"lru": 156, "2q": 192, "s3fifo": 192}

"""Two engines sharing one real redis-server as their remote KV tier (docs/prefix-pool.md, "Remote tier"):
the second reuses a prefix only the first has computed, with the greedy tokens of an engine without tiers,
and Redis killed mid-run changes no token and hangs no request."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import pytest
from redis_server import REDIS_SERVER, SKIP_REASON, RedisServer

from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import RequestOutput, SamplingParams

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
MAX_STEPS = 10_000


def prompt(seed: int, length: int) -> list[int]:
    """Token ids 3..252 (no BOS/EOS/pad), different for every seed."""
    return [3 + (seed * 131 + i * 17 + (i * i) % 7) % 250 for i in range(length)]


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with RedisServer(tmp_path) as server:
        yield server.url


@pytest.fixture(scope="module")
def reference(tiny_engine_dir: Path) -> Iterator[LLMEngine]:
    engine = LLMEngine.from_engine_dir(tiny_engine_dir)  # no tiers: the tokens every other run must give
    yield engine
    engine.close()


def tiered(tiny_engine_dir: Path, url: str) -> LLMEngine:
    engine = LLMEngine.from_engine_dir(tiny_engine_dir, kv_remote_url=url)
    assert engine.kv.tiers is not None and engine.kv.tiers.names == ["redis"]
    return engine


def run_one(engine: LLMEngine, rid: str, ids: list[int]) -> tuple[list[int], RequestOutput]:
    """One request to completion: its tokens and its final output (with its KV statistics)."""
    engine.add_request(rid, ids, GREEDY)
    tokens: list[int] = []
    for _ in range(MAX_STEPS):
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                assert out.error is None, out.error
                return tokens, out
    raise AssertionError(f"{rid} did not finish in {MAX_STEPS} steps")


def written(engine: LLMEngine) -> int:
    """Wait for the engine's writer to empty its queue; the blocks it wrote to Redis so far."""
    assert engine.kv.tiers is not None
    for writer in engine.kv.tiers.writers:
        writer.join()
    return engine.kv.tiers.stores[0].counters.writes


def test_the_second_server_reuses_a_prefix_only_the_first_has_seen(
        tiny_engine_dir: Path, redis_url: str, reference: LLMEngine) -> None:
    first, second = tiered(tiny_engine_dir, redis_url), tiered(tiny_engine_dir, redis_url)
    try:
        tpb = first.config.kv_cache.tokens_per_block
        system = prompt(1, 6 * tpb)  # six full blocks of shared prefix
        a, b = system + prompt(2, tpb // 2 + 3), system + prompt(3, tpb // 2 + 5)
        want_a, _ = run_one(reference, "ref-a", a)
        want_b, cold = run_one(reference, "ref-b", b)
        assert cold.stats.kv_cache_reused_blocks == 6  # the reference's own pool: the same prefix again

        got_a, out_a = run_one(first, "a", a)
        assert got_a == want_a and out_a.stats.kv_cache_reused_blocks == 0
        assert written(first) >= 6

        got_b, out_b = run_one(second, "b", b)  # second's pool is empty: the prefix comes from Redis
        assert got_b == want_b
        assert out_b.stats.kv_cache_reused_blocks == 6
        assert out_b.stats.prefill_tokens_computed == len(b) - 6 * tpb
        (snap,) = second.stats().kv_tiers
        assert (snap.name, snap.hit_blocks, snap.corrupt) == ("redis", 6, 0)
    finally:
        first.close()
        second.close()


def test_redis_killed_mid_run_changes_no_token_and_serving_goes_on(
        tiny_engine_dir: Path, tmp_path: Path, reference: LLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    tpb = reference.config.kv_cache.tokens_per_block
    early_prefix, late_prefix = prompt(4, 4 * tpb), prompt(5, 4 * tpb)
    early = {f"early{i}": early_prefix + prompt(10 + i, tpb + i) for i in range(3)}
    late = {f"late{i}": late_prefix + prompt(20 + i, tpb + i) for i in range(3)}
    want = {rid: run_one(reference, f"ref-{rid}", ids)[0] for rid, ids in {**early, **late}.items()}
    with RedisServer(tmp_path / "redis") as server:
        first = tiered(tiny_engine_dir, server.url)
        run_one(first, "warm-early", early_prefix + prompt(98, 3))
        run_one(first, "warm-late", late_prefix + prompt(99, 3))
        assert written(first) >= 8  # both prefixes are in Redis
        first.close()

        second = tiered(tiny_engine_dir, server.url)
        try:
            for rid, ids in early.items():
                second.add_request(rid, ids, GREEDY)
            got: dict[str, list[int]] = {}
            finished: list[str] = []
            with caplog.at_level(logging.WARNING):
                for step in range(MAX_STEPS):
                    if step == 3:
                        server.kill()  # mid-run: the early requests are loading or running
                        for rid, ids in late.items():  # these find Redis gone: misses, computed here
                            second.add_request(rid, ids, GREEDY)
                    for out in second.step():
                        assert out.error is None, out.error
                        got.setdefault(out.request_id, []).extend(out.new_token_ids)
                        finished += [out.request_id] if out.finished else []
                    if step > 3 and not second.has_unfinished_requests():
                        break
            assert sorted(finished) == sorted(want)  # every request ended, once
            assert got == want
            assert any("unreachable" in r.getMessage() for r in caplog.records)
            (snap,) = second.stats().kv_tiers
            assert snap.errors >= 1 and snap.misses >= 1
            after, _ = run_one(second, "after", late["late0"])  # serving goes on after the outage
            assert after == want["late0"]
        finally:
            second.close()

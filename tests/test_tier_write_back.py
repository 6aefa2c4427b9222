"""Write-back on eviction (kv_tier_write_policy=write_back), and the per-tier load-latency histogram.

The oracle is greedy decoding without tiers; a block's bytes on disk are compared with what
write-through stores for the same block (computed the same way), so a copy taken after the pool
handed the block out again would show.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import VOCAB, make_hf_model, run_to_completion
from tier_helpers import GREEDY, TPB, block_hashes, entry_path, fingerprint_of, plain_engine, run_one, tier_engine

from trtprompt.engine.loop import EngineLoop
from trtprompt.engine.tiers.disk_store import DiskStore
from trtprompt.serve import metrics_catalog as C
from trtprompt.serve.engine_process.counters import RequestCounters
from trtprompt.serve.engine_process.server import EngineService
from trtprompt.serve.triton_models.metrics_publisher import MetricsPublisher

BIG = 1 << 30
POOL_BLOCKS = 16  # one prompt of 12 blocks fits; a second one evicts most of the first


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama")


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(11)
    return {k: [rng.randrange(3, VOCAB) for _ in range(10 * TPB + 3)] for k in ("a", "c")}


@pytest.fixture(scope="module")
def reference(llama: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return run_to_completion(plain_engine(llama), prompts, GREEDY)


def _on_disk(store: DiskStore, fp: bytes, hashes: list[bytes]) -> set[bytes]:
    return {h for h in hashes if entry_path(store, fp, h).exists()}


def test_write_back_writes_evicted_blocks_then_the_pool_at_close(llama, tmp_path, prompts, reference):
    fp = fingerprint_of(llama)
    a_hashes = block_hashes(prompts["a"])
    store = DiskStore(tmp_path / "wb", BIG)
    engine = tier_engine(llama, [store], kv_tokens=POOL_BLOCKS * TPB, write_policy="write_back")
    assert run_one(engine, "a", prompts["a"])[0] == reference["a"]
    engine.kv.tiers.join_writes()
    assert store.counters.writes == 0  # nothing evicted yet: nothing written
    assert run_one(engine, "c", prompts["c"])[0] == reference["c"]  # needs a's blocks
    engine.kv.tiers.join_writes()
    evicted = {h for h in a_hashes if engine.kv.pool.lookup(h) is None}
    assert len(evicted) >= 4 and _on_disk(store, fp, a_hashes) == evicted
    assert store.counters.writes == engine.kv.pool.evicted_blocks  # every evicted block, once
    engine.close()  # a clean stop writes what the pool still holds
    assert _on_disk(store, fp, a_hashes) == set(a_hashes)

    # The same bytes write-through stores for those blocks: each copy was taken before the block was reused.
    through = DiskStore(tmp_path / "wt", BIG)
    wt = tier_engine(llama, [through])
    run_one(wt, "a", prompts["a"])
    wt.kv.tiers.join_writes()
    wt.close()
    for h in a_hashes:
        assert entry_path(store, fp, h).read_bytes() == entry_path(through, fp, h).read_bytes()

    again = tier_engine(llama, [DiskStore(tmp_path / "wb", BIG)], kv_tokens=POOL_BLOCKS * TPB,
                        write_policy="write_back")
    out, reused = run_one(again, "a", prompts["a"])
    assert out == reference["a"] and reused == len(a_hashes)
    disk = again.stats().kv_tiers[0]
    assert (disk.loaded_blocks, disk.hit_blocks, disk.corrupt) == (len(a_hashes), len(a_hashes), 0)
    # The load-latency histogram: one observation per block the disk returned.
    loads = again.kv.tiers.loader.latencies.drain()
    assert [t for t, _ in loads] == ["disk"] * len(a_hashes) and all(s > 0 for _, s in loads)
    assert again.kv.tiers.loader.latencies.drain() == []
    again.close()


def test_write_back_loses_what_an_unclean_stop_leaves_in_the_pool(llama, tmp_path, prompts, reference):
    """Without close() (a crash), only the blocks evicted so far are on disk; a restart reuses none of
    a prefix whose first block stayed in the pool, and computes it: the same tokens."""
    store = DiskStore(tmp_path / "wb", BIG)
    engine = tier_engine(llama, [store], kv_tokens=POOL_BLOCKS * TPB, write_policy="write_back")
    run_one(engine, "a", prompts["a"])
    engine.kv.tiers.join_writes()  # no close: the pool's blocks are never written
    assert len(store) == 0
    again = tier_engine(llama, [DiskStore(tmp_path / "wb", BIG)], write_policy="write_back")
    out, reused = run_one(again, "a", prompts["a"])
    assert out == reference["a"] and reused == 0
    again.close()
    engine.close()


def test_a_disk_budget_beyond_the_free_space_is_said_at_start(llama, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="trtprompt.engine.tiers.disk_store"):
        engine = tier_engine(llama, [DiskStore(tmp_path / "disk", 1 << 60)])
    assert "disk_cache_size is 1152921504606846976 bytes" in engine.kv.tiers.problems["disk"]
    assert [r.getMessage() for r in caplog.records] == [engine.kv.tiers.problems["disk"]]
    engine.close()
    fits = tier_engine(llama, [DiskStore(tmp_path / "ok", 1 << 20)])
    assert fits.kv.tiers.problems == {}
    fits.close()


class _Metric:
    def __init__(self, labels: dict[str, str], buckets: list[float] | None = None) -> None:
        self.labels, self.buckets, self.observed, self.value = labels, buckets, [], 0.0

    def observe(self, v: float) -> None:
        self.observed.append(v)

    def set(self, v: float) -> None:
        self.value = v

    def increment(self, v: float) -> None:
        self.value += v


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: list[tuple[str, _Metric]] = []

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind = name, kind

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> _Metric:  # noqa: N802
        m = _Metric(labels, buckets)
        _Family.made.append((self.name, m))
        return m


class _FakePbUtils:
    """pb_utils' metrics API as the publisher calls it, recording what it is given."""

    MetricFamily = _Family

    class Logger:
        @staticmethod
        def log_warn(message: str) -> None:
            raise AssertionError(message)


class _Direct:
    """The publisher's stats connection, answered by an EngineService in this process (no socket)."""

    def __init__(self, service: EngineService) -> None:
        self.service = service

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        if message["op"] == "info":
            return self.service.info()
        return self.service.stats(message["since"])


def test_tier_loads_reach_the_histogram_family_by_tier(llama, tmp_path, prompts, reference):
    store = DiskStore(tmp_path / "disk", BIG)
    filler = tier_engine(llama, [store])
    run_one(filler, "a", prompts["a"])
    filler.kv.tiers.join_writes()
    filler.close()
    engine = tier_engine(llama, [DiskStore(tmp_path / "disk", BIG)])
    assert run_one(engine, "a", prompts["a"])[0] == reference["a"]
    n = len(block_hashes(prompts["a"]))

    _Family.made = []
    publisher = MetricsPublisher(_FakePbUtils, str(tmp_path / "no.sock"), 1.0)
    publisher._conn = _Direct(EngineService(EngineLoop(engine)))  # type: ignore[assignment]
    publisher.poll_once()
    publisher.poll_once()  # nothing new: nothing observed twice
    tier_metrics = {m.labels["tier"]: m for name, m in _Family.made if name == C.TIER_LOAD.name}
    assert set(tier_metrics) == set(C.TIERS) and tier_metrics["disk"].buckets == list(C.TIER_LOAD_BUCKETS)
    assert len(tier_metrics["disk"].observed) == n and tier_metrics["redis"].observed == []
    engine.close()


def test_counters_keep_tier_loads_in_the_timings_sequence() -> None:
    counters = RequestCounters(tokens_per_block=TPB)
    counters.record_tier_loads([("disk", 0.002), ("redis", 0.004)])
    first = counters.snapshot(0)
    assert first["tier_loads"] == [["disk", 0.002], ["redis", 0.004]] and first["timings"] == []
    counters.record_tier_loads([("disk", 0.001)])
    assert counters.snapshot(first["seq"])["tier_loads"] == [["disk", 0.001]]

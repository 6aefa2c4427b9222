"""The disk tier under an engine: restarts, foreign engines, damaged entries, a full disk, drops.

The oracle is greedy decoding without tiers (and transformers' generate for the restart case):
whatever the tier holds or lacks, the tokens must not change.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
from pathlib import Path

import pytest
from engine_helpers import VOCAB, hf_greedy, make_hf_model, run_to_completion
from tier_helpers import (
    GREEDY,
    TPB,
    GatedStore,
    block_hashes,
    entry_path,
    fingerprint_of,
    plain_engine,
    run_one,
    tier_engine,
)

from trtprompt.engine.tiers.disk_store import DiskStore

BIG = 1 << 30


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama")


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, VOCAB) for _ in range(10 * TPB)]  # ten full blocks
    return {"a": shared + [5, 6, 7], "b": shared[: 6 * TPB] + [9, 9, 9, 9]}


@pytest.fixture(scope="module")
def reference(llama: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return run_to_completion(plain_engine(llama), prompts, GREEDY)


def _fill(llama: Path, root: Path, tokens: list[int], **kw: object) -> DiskStore:
    """Run tokens through an engine writing to a disk tier at root; close it (as a stopped server)."""
    store = DiskStore(root, BIG)
    engine = tier_engine(llama, [store], **kw)  # type: ignore[arg-type]
    run_one(engine, "fill", tokens)
    engine.kv.tiers.join_writes()
    engine.close()
    return store


def test_a_restarted_engine_reads_a_seen_prefix_from_disk(llama, tmp_path, prompts, reference):
    first = _fill(llama, tmp_path / "disk", prompts["a"])
    full = (len(prompts["a"]) - 1) // TPB
    assert first.counters.writes >= full and len(first) == first.counters.writes  # output blocks too

    store = DiskStore(tmp_path / "disk", BIG)  # a new process: the index is rebuilt from the directory
    assert len(store) == len(first) and store.used_bytes == first.used_bytes
    engine = tier_engine(llama, [store])
    out, reused = run_one(engine, "a", prompts["a"])
    assert reused >= 0.95 * full
    assert out == reference["a"] == hf_greedy(llama, tuple(prompts["a"]), GREEDY.max_tokens)
    stats = engine.stats()
    disk = stats.kv_tiers[0]
    assert (disk.name, disk.loaded_blocks, disk.hit_blocks, disk.corrupt) == ("disk", full, full, 0)
    assert stats.pool_hit_blocks == 0 and stats.reused_blocks == full
    assert store.counters.writes == 0  # blocks read from disk are not written back
    # b shares six blocks, now in the pool: pool hits, not disk reads
    out_b, reused_b = run_one(engine, "b", prompts["b"])
    assert out_b == reference["b"] and reused_b == 6
    assert engine.stats().pool_hit_blocks == 6
    engine.close()


def test_an_engine_with_another_fingerprint_reads_nothing(llama, tmp_path, prompts, reference):
    _fill(llama, tmp_path / "disk", prompts["a"])
    other = make_hf_model(tmp_path / "other", "llama", seed=1)  # other weights, same shapes
    assert fingerprint_of(other) != fingerprint_of(llama)
    store = DiskStore(tmp_path / "disk", BIG)
    engine = tier_engine(llama, [store], fingerprint=fingerprint_of(other))
    out, reused = run_one(engine, "a", prompts["a"])
    assert reused == 0 and out == reference["a"]
    assert store.counters.hits == 0 and engine.stats().kv_tiers[0].loaded_blocks == 0


def _damage(path: Path, how: str, donor: Path) -> None:
    data = path.read_bytes()
    if how == "corrupt":
        pos = len(data) - 100
        path.write_bytes(data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1:])
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":  # renamed into place but never written (a crash without fsync)
        path.write_bytes(b"")
    elif how == "foreign":  # a valid entry of another block, under this block's name
        path.write_bytes(donor.read_bytes())
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["corrupt", "truncated", "empty", "foreign"])
def test_a_damaged_entry_is_a_miss_and_is_reclaimed(llama, tmp_path, prompts, reference, how):
    fp = fingerprint_of(llama)
    store = _fill(llama, tmp_path / "disk", prompts["a"])
    hashes = block_hashes(prompts["a"])
    bad = entry_path(store, fp, hashes[4])
    _damage(bad, how, entry_path(store, fp, hashes[7]))

    store = DiskStore(tmp_path / "disk", BIG)
    engine = tier_engine(llama, [store])
    out, reused = run_one(engine, "a", prompts["a"])
    assert out == reference["a"]
    assert reused == 4  # the blocks before the damaged one
    assert engine.stats().kv_tiers[0].corrupt == 1 and store.counters.errors == 1
    engine.kv.tiers.join_writes()
    # reclaimed, then written again by the engine that computed the block (write-through)
    assert bad.read_bytes() != b"" and store.contains(fp + hashes[4])
    fresh = DiskStore(tmp_path / "disk2", BIG)
    assert fresh.counters.errors == 0
    engine.close()


def test_half_written_files_of_dead_writers_are_reclaimed_at_start(llama, tmp_path, prompts):
    store = _fill(llama, tmp_path / "disk", prompts["b"])
    target = entry_path(store, fingerprint_of(llama), block_hashes(prompts["b"])[0])
    dead = subprocess.run(["true"], check=True)  # a pid that has exited
    orphan = target.with_name(f"{target.name}.tmp-999999999-1")
    orphan.write_bytes(b"half")
    live = target.with_name(f"{target.name}.tmp-{os.getppid()}-1")  # a live writer's: left alone
    live.write_bytes(b"busy")
    del dead
    again = DiskStore(tmp_path / "disk", BIG)
    assert not orphan.exists() and live.exists() and again.reclaimed_temp_files == 1
    assert len(again) == len(store)


def test_the_budget_evicts_least_recently_used_entries(llama, tmp_path, prompts, reference):
    fp = fingerprint_of(llama)
    probe = _fill(llama, tmp_path / "probe", prompts["b"])
    entry = probe.used_bytes // len(probe)
    store = _fill(llama, tmp_path / "disk", prompts["a"])
    small = DiskStore(tmp_path / "disk", 4 * entry)  # restart with a smaller budget: the oldest go
    assert len(small) == 4 and small.used_bytes <= 4 * entry and small.counters.evictions == len(store) - 4
    hashes = block_hashes(prompts["a"])
    assert not small.contains(fp + hashes[0])  # written first, so least recently used
    engine = tier_engine(llama, [small])
    out, reused = run_one(engine, "a", prompts["a"])
    assert out == reference["a"] and reused == 0  # block 0 is gone: nothing after it can be used
    engine.kv.tiers.join_writes()
    assert small.used_bytes <= 4 * entry


def test_a_full_disk_stops_writing_with_one_warning(llama, tmp_path, prompts, reference, caplog):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with caplog.at_level(logging.WARNING, logger="trtprompt.engine.tiers.disk_store"):
            store = DiskStore(mnt, BIG)  # the budget is not what stops it: the disk is
            engine = tier_engine(llama, [store])
            out, _ = run_one(engine, "a", prompts["a"])
            engine.kv.tiers.join_writes()
            out_b, _ = run_one(engine, "b2", prompts["a"][:-3] + [11, 12])
            engine.kv.tiers.join_writes()
        assert out == reference["a"] and not store.writing
        full = [r for r in caplog.records if "disk is full" in r.getMessage()]
        assert len(full) == 1
        offered = engine.kv.tiers.writers[0].offered
        assert 0 < store.counters.writes < offered and store.counters.drops == offered - store.counters.writes
        assert engine.stats().kv_tiers[0].drops == store.counters.drops
        assert not list(mnt.rglob("*.tmp-*"))  # the failed write's temp file is gone
        engine.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_write_queue_drops_blocks_without_stalling_a_step(llama, tmp_path, prompts, reference):
    gated = GatedStore(DiskStore(tmp_path / "disk", BIG))
    gated.writes_open.clear()  # the tier accepts nothing for now
    engine = tier_engine(llama, [gated], queue_blocks=2)
    out, _ = run_one(engine, "a", prompts["a"])  # completes with the writer stuck
    assert out == reference["a"]
    writer = engine.kv.tiers.writers[0]
    queued = writer.offered - writer.queue_drops
    assert writer.offered >= 10
    assert queued in (2, 3)  # the queue's two, and perhaps one the writer took before it blocked
    gated.writes_open.set()
    engine.kv.tiers.join_writes()
    assert gated.counters.writes == queued and engine.stats().kv_tiers[0].drops == writer.queue_drops
    engine.close()


def _loading_held(llama, tmp_path, prompt):
    """An engine whose request "a" has its prefix on disk and waits there: the store's reads are held."""
    _fill(llama, tmp_path / "disk", prompt)
    gated = GatedStore(DiskStore(tmp_path / "disk", BIG))
    gated.reads_open.clear()
    engine = tier_engine(llama, [gated])
    engine.add_request("a", prompt, GREEDY)
    return engine, gated


def test_a_request_waiting_for_a_load_does_not_hold_up_others(llama, tmp_path, prompts, reference):
    engine, gated = _loading_held(llama, tmp_path, prompts["a"])
    other = [3 + (i * 7) % (VOCAB - 3) for i in range(3 * TPB + 2)]
    engine.add_request("other", other, GREEDY)
    outs: dict[str, list[int]] = {"a": [], "other": []}
    done: set[str] = set()
    for _ in range(200):  # until "other" is done, with a's read held
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
            if o.finished:
                done.add(o.request_id)
        if "other" in done:
            break
    assert done == {"other"} and outs["a"] == []
    assert gated.reads_started.is_set() and engine.stats().loading_requests == 1
    gated.reads_open.set()
    reused = 0
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reused = o.stats.kv_cache_reused_blocks
    assert outs["a"] == reference["a"] and reused == 10
    assert outs["other"] == run_to_completion(plain_engine(llama), {"x": other}, GREEDY)["x"]
    engine.close()


def test_an_abort_while_loading_ends_the_request_once(llama, tmp_path, prompts, reference):
    engine, gated = _loading_held(llama, tmp_path, prompts["a"])
    assert engine.step() == [] and engine.stats().loading_requests == 1
    assert engine.abort("a")
    finals = [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == ["a"]
    gated.reads_open.set()
    engine.add_request("a", prompts["a"], GREEDY)  # the same id again, while the old load may still run
    out, _ = [], 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
    assert out == reference["a"] and engine.stats().waiting_requests == 0
    engine.close()


def test_selective_writes_only_blocks_reused_in_the_pool(llama, tmp_path, prompts, reference):
    store = DiskStore(tmp_path / "disk", BIG)
    engine = tier_engine(llama, [store], write_policy="selective")
    out, _ = run_one(engine, "a", prompts["a"])
    engine.kv.tiers.join_writes()
    assert out == reference["a"] and store.counters.writes == 0  # seen once: nothing written
    out_b, reused = run_one(engine, "b", prompts["b"])
    engine.kv.tiers.join_writes()
    assert out_b == reference["b"] and reused == 6 and store.counters.writes == 6
    hashes = block_hashes(prompts["a"])
    fp = fingerprint_of(llama)
    assert all(store.contains(fp + h) for h in hashes[:6]) and not store.contains(fp + hashes[6])
    engine.close()


def test_the_cache_salt_separates_tenants_on_disk_too(llama, tmp_path, prompts, reference):
    store = DiskStore(tmp_path / "disk", BIG)
    engine = tier_engine(llama, [store])
    engine.add_request("t1", prompts["a"], GREEDY, cache_salt="tenant-1")
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.tiers.join_writes()
    engine.close()
    for salt, expected in (("tenant-2", 0), (None, 0), ("tenant-1", 10)):
        again = tier_engine(llama, [DiskStore(tmp_path / "disk", BIG)])
        again.add_request("r", prompts["a"], GREEDY, cache_salt=salt)
        out: list[int] = []
        reused = -1
        while again.has_unfinished_requests():
            for o in again.step():
                out.extend(o.new_token_ids)
                reused = o.stats.kv_cache_reused_blocks if o.finished else reused
        assert (salt, reused, out) == (salt, expected, reference["a"])
        again.kv.tiers.join_writes()
        again.close()

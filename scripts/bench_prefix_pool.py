#!/usr/bin/env python3
"""The disk tier, measured: TTFT after a restart vs in-pool warm vs cold, the tiers' cost without
reuse, and the disk tier's read rate beside dd's.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_prefix_pool.py ENGINE_DIR [--prefix-len 960]
        [--repeats 5] [--no-reuse-requests 24] [--disk-dir DIR] [--out results.json]

In one process, alternating within each repeat so the ratios share conditions:
- cold: an engine without tiers serves prefix + question A, a prefix it has never seen;
- warm: the same engine serves prefix + question B (prefix blocks in its pool);
- restart: an engine with a disk tier served prefix + question A and was closed; a NEW engine over
  the same directory (its pool empty, its disk index rebuilt from the files) serves prefix + B.
  The OS page cache keeps the files, as it does for a restarted server on the same machine.
Greedy tokens of "restart" are checked against "warm". Then throughput of distinct prompts (no
reuse) with tiers off, write_through and selective, in alternating order; then reads of every
stored block (get + verify) against `dd` of one large file. docs/prefix-pool.md, "Measurements".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams
from trtprompt.engine.tiers.codec import decode

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)
POOL_TOKENS = 32768


def engine(path: Path, **tiers: object) -> LLMEngine:
    return LLMEngine.from_engine_dir(path, max_tokens_in_paged_kv_cache=POOL_TOKENS, **tiers)


def ttft(eng: LLMEngine, rid: str, ids: list[int]) -> tuple[float, list[int], int]:
    """Seconds to the first token, all tokens, blocks reused."""
    t0 = time.perf_counter()
    eng.add_request(rid, ids, PARAMS)
    first = None
    tokens: list[int] = []
    reused = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
            tokens += out.new_token_ids
            if out.finished:
                reused = out.stats.kv_cache_reused_blocks
    assert first is not None
    return first, tokens, reused


def measure_ttft(path: Path, disk: Path, prefix_len: int, repeats: int, vocab: int) -> dict[str, object]:
    rng = random.Random(0)
    rows: dict[str, list[float]] = {"cold": [], "warm": [], "restart": []}
    cached: list[int] = []
    plain = engine(path)
    ttft(plain, "warmup", [rng.randrange(3, vocab) for _ in range(prefix_len)])  # first-call costs left out
    for r in range(repeats):
        prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
        qa, qb = [rng.randrange(3, vocab) for _ in range(12)], [rng.randrange(3, vocab) for _ in range(12)]
        rows["cold"].append(ttft(plain, f"cold{r}", prefix + qa)[0])
        t_warm, warm_tokens, _ = ttft(plain, f"warm{r}", prefix + qb)
        rows["warm"].append(t_warm)
        writer = engine(path, disk_cache_path=str(disk))
        ttft(writer, f"fill{r}", prefix + qa)
        assert writer.kv.tiers is not None
        writer.kv.tiers.join_writes()
        writer.close()
        restarted = engine(path, disk_cache_path=str(disk))
        t_restart, tokens, reused = ttft(restarted, f"restart{r}", prefix + qb)
        restarted.close()
        assert tokens == warm_tokens, "restart changed the greedy tokens"
        rows["restart"].append(t_restart)
        cached.append(reused)
    med = {k: statistics.median(v) for k, v in rows.items()}
    full = (prefix_len + 12 - 1) // plain.kv.tokens_per_block
    return {"median_s": med, "all_s": rows, "cached_blocks": cached, "full_blocks": full,
            "restart_over_warm": med["restart"] / med["warm"], "restart_over_cold": med["restart"] / med["cold"]}


def throughput(eng: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=16, temperature=0.0))
    n = 0
    while eng.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in eng.step())
    if eng.kv.tiers is not None:
        eng.kv.tiers.join_writes()  # the writes' cost counts
    return n / (time.perf_counter() - t0)


def measure_cost(path: Path, disk: Path, n: int, vocab: int, repeats: int) -> dict[str, object]:
    variants = {"off": {}, "write_through": {"disk_cache_path": str(disk / "wt")},
                "selective": {"disk_cache_path": str(disk / "sel"), "kv_tier_write_policy": "selective"}}
    engines = {k: engine(path, **v) for k, v in variants.items()}
    rng = random.Random(1)
    for k, e in engines.items():  # first-call costs left out
        throughput(e, [[rng.randrange(3, vocab) for _ in range(64)]], f"warmup-{k}")
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(repeats):
        prompts = [[rng.randrange(3, vocab) for _ in range(256)] for _ in range(n)]
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for k in order:
            rates[k].append(throughput(engines[k], prompts, f"{k}{r}-"))
    drops = {k: [t.drops for t in e.stats().kv_tiers] for k, e in engines.items()}
    for e in engines.values():
        e.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"output_tok_s": med, "all": rates, "drops": drops,
            "cost_write_through": 1 - med["write_through"] / med["off"],
            "cost_selective": 1 - med["selective"] / med["off"]}


def measure_reads(path: Path, disk: Path) -> dict[str, object]:
    eng = engine(path, disk_cache_path=str(disk))
    assert eng.kv.tiers is not None
    store = eng.kv.tiers.stores[0]
    names = [p.name for p in disk.rglob("*") if p.is_file() and len(p.name) == 64]
    t0 = time.perf_counter()
    total = 0
    for name in names:
        data = store.get(bytes.fromhex(name))
        assert data is not None
        total += len(decode(bytes.fromhex(name), data, eng.kv.tiers.layout.block_bytes))
    seconds = time.perf_counter() - t0
    eng.close()
    big = disk.parent / "dd.bin"
    subprocess.run(["dd", "if=/dev/zero", f"of={big}", "bs=4M", f"count={max(total >> 22, 16)}"],
                   check=True, capture_output=True)
    dd = subprocess.run(["dd", f"if={big}", "of=/dev/null", "bs=4M"], check=True, capture_output=True, text=True)
    big.unlink()
    return {"blocks": len(names), "bytes": total, "get_verify_gb_s": total / seconds / 1e9,
            "dd_cached": dd.stderr.strip().splitlines()[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", type=Path)
    ap.add_argument("--prefix-len", type=int, default=960)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-reuse-requests", type=int, default=24)
    ap.add_argument("--disk-dir", type=Path, help="where the disk tier lives (default: a temp dir on /tmp's disk)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", nargs="+", choices=["ttft", "reads", "no_reuse"],
                    help="parts to run (reads needs ttft first: it reads the blocks ttft stored)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-prefix-pool-", dir=args.disk_dir))
    vocab = int(json.loads((args.engine / "config.json").read_text())["pretrained_config"]["vocab_size"])
    result: dict[str, object] = {"cpu": cpu_name()}
    parts = {"ttft": lambda: measure_ttft(args.engine, root / "ttft", args.prefix_len, args.repeats, vocab),
             "reads": lambda: measure_reads(args.engine, root / "ttft"),
             "no_reuse": lambda: measure_cost(args.engine, root / "cost", args.no_reuse_requests, vocab,
                                              args.repeats)}
    try:
        for name in args.only or list(parts):
            result[name] = parts[name]()
            print(json.dumps({name: result[name]}, indent=2), flush=True)  # each part as soon as it is done
            if args.out:
                args.out.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    return "unknown"


if __name__ == "__main__":
    main()

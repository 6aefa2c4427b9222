#!/usr/bin/env python3
"""The disk tier, measured: TTFT after a restart vs in-pool warm vs cold, what each write policy keeps
across a restart, the tiers' cost without reuse, and the disk tier's read rate beside dd's.

    flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.prefix_pool ENGINE_DIR [--prefix-len 960]
        [--repeats 5] [--no-reuse-requests 24] [--cost-pool-tokens 8192] [--disk-dir DIR] [--out results.json]
        [--only ttft policies reads write_path no_reuse]

In one process, alternating within each repeat so the ratios share conditions:
- cold: an engine without tiers serves prefix + question A, a prefix it has never seen;
- warm: the same engine serves prefix + question B (prefix blocks in its pool);
- restart: an engine with a disk tier served prefix + question A and was closed; a NEW engine over
  the same directory (its pool empty, its disk index rebuilt from the files) serves prefix + B.
  The OS page cache keeps the files, as it does for a restarted server on the same machine.
Greedy tokens of "restart" are checked against "warm". "policies": per write policy, an engine
serves prefix + A, then a new engine serves prefix + B twice over: once while the first is still
open (as after a crash: only what was written so far is on disk), once after it was closed (a clean
stop; write_back writes the pool then). Then throughput of distinct prompts (no reuse) with tiers
off and under each write policy, in rotating order, over a pool small enough that every round
evicts the previous round's blocks (--cost-pool-tokens: write_back's steady state); then reads of
every stored block (get + verify) against `dd` of one large file. docs/prefix-pool.md, "Measurements".
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from trtprompt.bench import machine
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import SamplingParams
from trtprompt.engine.tiers.codec import decode

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)
POOL_TOKENS = 32768
POLICIES = ("write_through", "selective", "write_back")


def engine(path: Path, **tiers: Any) -> LLMEngine:
    """An engine over path with POOL_TOKENS of KV pool and these tier options."""
    return LLMEngine.from_engine_dir(path, max_tokens_in_paged_kv_cache=POOL_TOKENS, **tiers)


def tiers_of(eng: LLMEngine) -> Any:
    """The engine's tiers (it was opened with one)."""
    if eng.kv.tiers is None:
        raise RuntimeError("the engine has no KV tier")
    return eng.kv.tiers


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
    if first is None:
        raise RuntimeError(f"request {rid} finished without a token")
    return first, tokens, reused


def cold_then_warm(plain: LLMEngine, rng: random.Random, prefix_len: int, vocab: int, r: int,
                   rows: dict[str, list[float]]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Round r's new prefix and two questions; its cold TTFT (question a) and its in-pool warm TTFT
    (question b) appended to rows. Returns (prefix, a, b, warm greedy tokens)."""
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    qa, qb = [rng.randrange(3, vocab) for _ in range(12)], [rng.randrange(3, vocab) for _ in range(12)]
    rows["cold"].append(ttft(plain, f"cold{r}", prefix + qa)[0])
    t_warm, warm_tokens, _ = ttft(plain, f"warm{r}", prefix + qb)
    rows["warm"].append(t_warm)
    return prefix, qa, qb, warm_tokens


def measure_ttft(path: Path, disk: Path, prefix_len: int, repeats: int, vocab: int) -> dict[str, object]:
    rng = random.Random(0)
    rows: dict[str, list[float]] = {"cold": [], "warm": [], "restart": []}
    cached: list[int] = []
    plain = engine(path)
    ttft(plain, "warmup", [rng.randrange(3, vocab) for _ in range(prefix_len)])  # first-call costs left out
    for r in range(repeats):
        prefix, qa, qb, warm_tokens = cold_then_warm(plain, rng, prefix_len, vocab, r, rows)
        writer = engine(path, disk_cache_path=str(disk))
        ttft(writer, f"fill{r}", prefix + qa)
        tiers_of(writer).join_writes()
        writer.close()
        restarted = engine(path, disk_cache_path=str(disk))
        t_restart, tokens, reused = ttft(restarted, f"restart{r}", prefix + qb)
        restarted.close()
        if tokens != warm_tokens:
            raise RuntimeError("restart changed the greedy tokens")
        rows["restart"].append(t_restart)
        cached.append(reused)
    med = {k: statistics.median(v) for k, v in rows.items()}
    full = (prefix_len + 12 - 1) // plain.kv.tokens_per_block
    return {"median_s": med, "all_s": rows, "cached_blocks": cached, "full_blocks": full,
            "restart_over_warm": med["restart"] / med["warm"], "restart_over_cold": med["restart"] / med["cold"]}


def policy_stops(path: Path, disk: Path, policy: str, r: int, prefix: list[int], qa: list[int], qb: list[int],
                 warm_tokens: list[int]) -> dict[str, tuple[float, int]]:
    """One policy in round r: a first engine fills the tier; a new engine reads it after a crash and after a
    clean stop. Per stop, the new engine's TTFT and blocks reused."""
    root = disk / f"{policy}-{r}"
    first = engine(path, disk_cache_path=str(root), kv_tier_write_policy=policy)
    ttft(first, f"fill{r}", prefix + qa)
    tiers_of(first).join_writes()
    out: dict[str, tuple[float, int]] = {}
    for stop in ("crash", "clean"):
        if stop == "clean":
            first.close()  # write_back writes the pool's blocks here
        # The new engine reads a copy of the directory as the stop left it, so its own writes
        # (and the first engine's later close) change no other row.
        seen = disk / f"{policy}-{r}-{stop}"
        shutil.copytree(root, seen)
        again = engine(path, disk_cache_path=str(seen), kv_tier_write_policy=policy)
        t, tokens, n = ttft(again, f"{stop}{r}", prefix + qb)
        again.close()
        if tokens != warm_tokens:
            raise RuntimeError(f"{policy} after a {stop} stop changed the greedy tokens")
        out[stop] = (t, n)
    return out


def measure_policies(path: Path, disk: Path, prefix_len: int, repeats: int, vocab: int) -> dict[str, object]:
    """Per write policy: TTFT and blocks reused by a new engine after a crash and after a clean stop."""
    rng = random.Random(2)
    plain = engine(path)
    ttft(plain, "warmup", [rng.randrange(3, vocab) for _ in range(prefix_len)])
    rows: dict[str, list[float]] = {"cold": [], "warm": []}
    reused: dict[str, list[int]] = {}
    for r in range(repeats):
        prefix, qa, qb, warm_tokens = cold_then_warm(plain, rng, prefix_len, vocab, r, rows)
        for policy in POLICIES:
            for stop, (t, n) in policy_stops(path, disk, policy, r, prefix, qa, qb, warm_tokens).items():
                rows.setdefault(f"{policy}_{stop}", []).append(t)
                reused.setdefault(f"{policy}_{stop}", []).append(n)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"median_s": med, "all_s": rows, "reused_blocks": reused,
            "full_blocks": (prefix_len + 12 - 1) // plain.kv.tokens_per_block,
            "over_cold": {k: v / med["cold"] for k, v in med.items()},
            "over_warm": {k: v / med["warm"] for k, v in med.items()}}


def throughput(eng: LLMEngine, prompts: list[list[int]], tag: str) -> tuple[float, float]:
    """Prompt plus output tokens per wall second, and CPU seconds of this process (every thread: the
    engine's and the writers') per token. Prefill dominates: 256 in, 16 out."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=16, temperature=0.0))
    n = sum(len(p) for p in prompts)
    while eng.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in eng.step())
    if eng.kv.tiers is not None:
        eng.kv.tiers.join_writes()  # the writes' cost counts
    return n / (time.perf_counter() - t0), (time.process_time() - c0) / n


def rotating_rounds(engines: dict[str, LLMEngine], rng: random.Random, n: int, vocab: int,
                    repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per variant and round: tokens/s and CPU s per token on the round's distinct prompts."""
    rates: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    names = list(engines)
    for r in range(repeats):
        prompts = [[rng.randrange(3, vocab) for _ in range(256)] for _ in range(n)]
        for k in names[r % len(names):] + names[:r % len(names)]:  # each variant first in turn
            rate, cpu_per_token = throughput(engines[k], prompts, f"{k}{r}-")
            rates[k].append(rate)
            cpu[k].append(cpu_per_token)
    return rates, cpu


def measure_cost(path: Path, disk: Path, n: int, vocab: int, repeats: int, pool_tokens: int) -> dict[str, object]:
    """Each round runs the same distinct prompts through every variant back to back (rotating which goes
    first); a variant's cost is the median over rounds of its ratio to "off" in the same round, so a
    change of the machine's load between rounds cancels out (other agents share this machine)."""
    variants: dict[str, dict[str, Any]] = {"off": {}}
    variants.update({p: {"disk_cache_path": str(disk / p), "kv_tier_write_policy": p} for p in POLICIES})
    engines = {k: LLMEngine.from_engine_dir(path, max_tokens_in_paged_kv_cache=pool_tokens, **v)
               for k, v in variants.items()}
    rng = random.Random(1)
    fill = [[rng.randrange(3, vocab) for _ in range(256)] for _ in range(max(n, pool_tokens // 256))]
    for k, e in engines.items():  # first-call costs left out; the pool full, so round 0 evicts too
        throughput(e, fill, f"warmup-{k}")
    rates, cpu = rotating_rounds(engines, rng, n, vocab, repeats)
    tiers = {k: [{"writes": t.writes, "drops": t.drops, "bytes_written": t.bytes_written}
                 for t in e.stats().kv_tiers] for k, e in engines.items()}
    evicted = {k: e.kv.pool.evicted_blocks for k, e in engines.items()}
    for e in engines.values():
        e.close()
    wall_cost = {p: 1 - statistics.median(a / b for a, b in zip(rates[p], rates["off"])) for p in POLICIES}
    cpu_cost = {p: statistics.median(a / b for a, b in zip(cpu[p], cpu["off"])) - 1 for p in POLICIES}
    return {"tok_s": rates, "cpu_s_per_token": cpu, "tiers": tiers, "evicted_blocks": evicted,
            "pool_tokens": pool_tokens, "requests_per_round": n,
            "throughput_cost_median_paired": wall_cost, "cpu_cost_median_paired": cpu_cost}


def measure_write_path(path: Path, disk: Path, rounds: int = 15) -> dict[str, object]:
    """Where a written block's time goes, in microseconds per block (min of rounds, 8 blocks a round, as
    one 256-token prompt): the engine thread's copy out of the pool, then the writer thread's framing
    (crc32 + header) and disk write; beside them the block hash every full block pays anyway."""
    from trtprompt.engine.block_pool import hash_block
    from trtprompt.engine.tiers.codec import encode

    eng = engine(path, disk_cache_path=str(disk))
    tiers = tiers_of(eng)
    store = tiers.stores[0]
    ids = list(range(8))
    tokens = list(range(eng.kv.tokens_per_block))
    best = dict.fromkeys(("copy_out", "encode", "disk_put", "hash_block"), float("inf"))
    for r in range(rounds):
        t0 = time.perf_counter()
        payloads = tiers.copy_out(ids)
        t1 = time.perf_counter()
        framed = [encode(tiers.key(bytes([r, i]) * 8), p.data) for i, p in enumerate(payloads)]
        t2 = time.perf_counter()
        for i, data in enumerate(framed):
            store.put(tiers.key(bytes([r, i]) * 8), data)
        t3 = time.perf_counter()
        for _ in ids:
            hash_block(None, tokens, None)
        t4 = time.perf_counter()
        for k, v in zip(best, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            best[k] = min(best[k], v / len(ids) * 1e6)
    eng.close()
    return {"us_per_block": best, "block_bytes": tiers.layout.block_bytes}


def measure_reads(path: Path, disk: Path) -> dict[str, object]:
    """Every block the ttft part stored, read back and verified, beside dd reading one large file."""
    eng = engine(path, disk_cache_path=str(disk))
    tiers = tiers_of(eng)
    store = tiers.stores[0]
    names = [p.name for p in disk.rglob("*") if p.is_file() and len(p.name) == 64]
    t0 = time.perf_counter()
    total = 0
    for name in names:
        data = store.get(bytes.fromhex(name))
        if data is None:
            raise RuntimeError(f"block {name} is on disk but the store does not return it")
        total += len(decode(bytes.fromhex(name), data, tiers.layout.block_bytes))
    seconds = time.perf_counter() - t0
    eng.close()
    big = disk.parent / "dd.bin"
    subprocess.run(["dd", "if=/dev/zero", f"of={big}", "bs=4M", f"count={max(total >> 22, 16)}"],
                   check=True, capture_output=True)
    dd = subprocess.run(["dd", f"if={big}", "of=/dev/null", "bs=4M"], check=True, capture_output=True, text=True)
    big.unlink()
    return {"blocks": len(names), "bytes": total, "get_verify_gb_s": total / seconds / 1e9,
            "dd_cached": dd.stderr.strip().splitlines()[-1]}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("engine", type=Path)
    ap.add_argument("--prefix-len", type=int, default=960)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-reuse-requests", type=int, default=24)
    ap.add_argument("--cost-pool-tokens", type=int, default=8192,
                    help="KV pool of the no-reuse runs (small: every round evicts the last one's blocks)")
    ap.add_argument("--disk-dir", type=Path, help="where the disk tier lives (default: a temp dir on /tmp's disk)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", nargs="+", choices=["ttft", "policies", "reads", "write_path", "no_reuse"],
                    help="parts to run (reads needs ttft first: it reads the blocks ttft stored)")
    return ap.parse_args()


def parts_of(args: argparse.Namespace, root: Path, vocab: int) -> dict[str, Callable[[], dict[str, object]]]:
    return {"ttft": lambda: measure_ttft(args.engine, root / "ttft", args.prefix_len, args.repeats, vocab),
            "policies": lambda: measure_policies(args.engine, root / "policies", args.prefix_len, args.repeats,
                                                 vocab),
            "reads": lambda: measure_reads(args.engine, root / "ttft"),
            "write_path": lambda: measure_write_path(args.engine, root / "write_path"),
            "no_reuse": lambda: measure_cost(args.engine, root / "cost", args.no_reuse_requests, vocab,
                                             args.repeats, args.cost_pool_tokens)}


def main() -> None:
    args = parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-prefix-pool-", dir=args.disk_dir))
    vocab = int(json.loads((args.engine / "config.json").read_text())["pretrained_config"]["vocab_size"])
    info = machine.describe()
    result: dict[str, object] = {"cpu": machine.one_line(info), "machine": info}
    parts = parts_of(args, root, vocab)
    try:
        for name in args.only or list(parts):
            result[name] = parts[name]()
            print(json.dumps({name: result[name]}, indent=2), flush=True)  # each part as soon as it is done
            if args.out:
                args.out.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

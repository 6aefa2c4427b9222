#!/usr/bin/env python3
"""Eviction policies against a scan of one-off long prompts, and what they cost (docs/prefix-pool.md, "Eviction").

    flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.eviction pool     # pool-level simulation
    flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.eviction engine   # through LLMEngine
    flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.eviction micro    # ns per BlockPool operation
    flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.eviction noreuse  # no shared prefix

The workload (trtprompt/bench/eviction_sim.py): 8 system prompts of 4 blocks take 80 % of the
requests (each with a unique 40-token tail), one-off prompts of 32 blocks (a quarter of the pool)
the other 20 %, 3x the pool's blocks in all; a warm-up of 2 requests per system prompt first. The
hot-prefix hit rate (system-prompt blocks served from the cache) is compared with the same hot
requests without the one-off prompts. Every variant runs side by side in one process.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from trtprompt.bench.eviction_sim import (
    ARRANGEMENTS,
    HitCounts,
    ScanWorkload,
    SimRequest,
    make_requests,
    note_hits,
    run_pool,
)
from trtprompt.bench.machine import ROOT
from trtprompt.engine.block_pool import BlockPool
from trtprompt.knobs import EVICTION_POLICIES

SEEDS = range(10)


def _add(total: HitCounts, c: HitCounts) -> None:
    """Adds c's counts to total."""
    total.hot_hits += c.hot_hits
    total.hot_queried += c.hot_queried
    total.hits += c.hits
    total.evicted += c.evicted


def _row(label: str, policy: str, base: HitCounts, scan: HitCounts) -> str:
    ratio = scan.hot_hit_rate / base.hot_hit_rate if base.hot_hit_rate else 0.0
    return (f"| {label} | {policy} | {base.hot_hit_rate:.3f} | {scan.hot_hit_rate:.3f} | {ratio:.3f} | "
            f"{scan.hits} | {scan.evicted} |")


HEADER = ("| workload | policy | hot hit rate, no scan | with scan | ratio (target >= 0.9) | all hits (blocks) "
          "| evictions |\n|---|---|---|---|---|---|---|")


def bench_pool(args: argparse.Namespace) -> None:
    """Hot-prefix hit rate with and without the scan, per arrangement, concurrency and policy (seeds 0-9)."""
    print(HEADER)
    variants: list[tuple[str, str, int, dict[str, Any]]] = [(f"{a}, {c} in flight", a, c, {})
                                                             for a in ARRANGEMENTS for c in (2, 4)]
    # A hot set that outgrows the main queue: 24 system prompts (96 blocks), Zipf popularity.
    variants.append(("interleaved, 2 in flight, 24 system prompts, Zipf 1.0", "interleaved", 2,
                     {"num_hot": 24, "hot_skew": 1.0}))
    for label, arrangement, concurrency, extra in variants:
        for policy in EVICTION_POLICIES:
            base, scan = HitCounts(), HitCounts()
            for seed in SEEDS:
                w = ScanWorkload(arrangement=arrangement, seed=seed, **extra)
                _add(base, run_pool(w, make_requests(w, False), policy, concurrency))
                _add(scan, run_pool(w, make_requests(w, True), policy, concurrency))
            print(_row(f"{label}, seeds 0-9", policy, base, scan))


def _tiny_engine_dir(root: Path) -> Path:
    from trtprompt.build import BuildRequest, run_build
    from trtprompt.checkpoint_maker import DemoSpec, make_demo_checkpoint

    out = root / "engine"
    if not (out / "config.json").exists():
        ckpt = make_demo_checkpoint(root / "ckpt", DemoSpec())
        if run_build(BuildRequest(ckpt, out, "cpu-dev", progress=False)) is None:
            raise RuntimeError(f"building the tiny engine into {out} produced nothing")
    return out


def run_engine(engine_dir: Path, w: ScanWorkload, requests: list[SimRequest], policy: str, concurrency: int,
               reuse: bool = True) -> tuple[HitCounts, list[list[int]], float]:
    """Serve requests through LLMEngine, at most concurrency at a time; hits from each request's own stats."""
    from trtprompt.engine.engine import LLMEngine
    from trtprompt.engine.request import SamplingParams

    engine = LLMEngine.from_engine_dir(engine_dir, kv_cache_eviction_policy=policy, enable_kv_cache_reuse=reuse,
                                       max_tokens_in_paged_kv_cache=w.num_blocks * w.tokens_per_block)
    if engine.kv.pool.num_blocks != w.num_blocks:
        raise RuntimeError(f"the pool has {engine.kv.pool.num_blocks} blocks, the workload wants {w.num_blocks}")
    params = SamplingParams(max_tokens=w.output_tokens, temperature=0.0)
    counts = HitCounts()
    outputs: list[list[int]] = [[] for _ in requests]
    pending = deque(enumerate(requests))
    running: set[str] = set()
    start = time.perf_counter()
    while pending or running:
        while pending and len(running) < concurrency:
            i, r = pending.popleft()
            engine.add_request(str(i), list(r.tokens), params)
            running.add(str(i))
        for out in engine.step():
            outputs[int(out.request_id)].extend(out.new_token_ids)
            if out.finished:
                running.discard(out.request_id)
                note_hits(counts, requests[int(out.request_id)], out.stats.kv_cache_reused_blocks, w.hot_blocks)
    elapsed = time.perf_counter() - start
    counts.evicted = engine.kv.pool.evicted_blocks
    return counts, outputs, elapsed


def bench_engine(args: argparse.Namespace) -> None:
    """The same through LLMEngine on the tiny demo engine, and whether the greedy tokens match across policies."""
    engine_dir = _tiny_engine_dir(Path(args.work))
    print(HEADER)
    for arrangement in ARRANGEMENTS:
        tokens: dict[str, list[list[int]]] = {}
        for policy in EVICTION_POLICIES:
            base, scan = HitCounts(), HitCounts()
            for seed in range(args.seeds):
                w = ScanWorkload(arrangement=arrangement, seed=seed)
                _add(base, run_engine(engine_dir, w, make_requests(w, False), policy, 2)[0])
                c, out, _ = run_engine(engine_dir, w, make_requests(w, True), policy, 2)
                _add(scan, c)
                tokens.setdefault(policy, []).extend(out)
            print(_row(f"engine, {arrangement}, 2 in flight, seeds 0-{args.seeds - 1}", policy, base, scan))
        same = all(tokens[p] == tokens[EVICTION_POLICIES[0]] for p in EVICTION_POLICIES)
        print(f"<!-- {arrangement}: greedy tokens equal under every policy: {same} -->")


def bench_noreuse(args: argparse.Namespace) -> None:
    """Engine throughput on unique prompts (every block evicted once): policies side by side, rounds alternated."""
    engine_dir = _tiny_engine_dir(Path(args.work))
    w = ScanWorkload(hot_share=0.01, scan_volume=6.0, one_off_blocks=8, warmup=0)
    reqs = [r for r in make_requests(w, True) if r.hot is None]
    variants = [(p, True) for p in EVICTION_POLICIES] + [("lru", False)]
    times: dict[tuple[str, bool], list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            _, _, elapsed = run_engine(engine_dir, w, reqs, v[0], 4, reuse=v[1])
            times[v].append(elapsed)
    tokens = sum(len(r.tokens) + w.output_tokens for r in reqs)
    ref = statistics.median(times[("lru", True)])
    print(f"{len(reqs)} unique prompts of {len(reqs[0].tokens)} tokens, {w.output_tokens} output tokens, "
          f"4 in flight, {args.rounds} rounds (median)\n")
    print("| policy | reuse | median s | tokens/s | vs lru |\n|---|---|---|---|---|")
    for (policy, reuse), ts in times.items():
        med = statistics.median(ts)
        print(f"| {policy} | {'on' if reuse else 'off'} | {med:.3f} | {tokens / med:.0f} | {med / ref:.3f} |")


# The pool before issue 24 (one LRU queue, no priorities): the reference the micro benchmark times beside.
OLD_POOL_COMMIT = "a0250bb^"


def _old_pool_class() -> type:
    src = subprocess.run(["git", "show", f"{OLD_POOL_COMMIT}:trtprompt/engine/block_pool.py"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    spec = importlib.util.spec_from_loader("old_block_pool", loader=None)
    if spec is None:
        raise RuntimeError("could not make a module spec for the old block pool")
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_block_pool"] = module  # dataclasses look their module up
    exec(compile(src, "old_block_pool.py", "exec"), module.__dict__)
    return module.BlockPool  # type: ignore[no-any-return]


def bench_micro(args: argparse.Namespace) -> None:
    """ns per block for allocate (evicting a cached block), touch (a hit) and free, per policy."""
    n, rounds = 4096, args.rounds
    old = _old_pool_class()
    makers: dict[str, Callable[[], Any]] = {"before (one LRU queue)": lambda: old(n, True)}
    makers |= {p: functools.partial(BlockPool, n, True, p) for p in EVICTION_POLICIES}
    print(f"{n} blocks, {rounds} rounds alternated, medians\n")
    print("| pool | allocate+evict ns/block | touch (hit) ns/block | free ns/block |\n|---|---|---|---|")
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in makers}
    for _ in range(rounds):
        for name, make in makers.items():
            results[name].append(_micro_once(make(), n))
    for name, rs in results.items():
        a, t, f = (statistics.median(x[i] for x in rs) for i in range(3))
        print(f"| {name} | {a:.0f} | {t:.0f} | {f:.0f} |")


def _micro_once(pool: Any, n: int) -> tuple[float, float, float]:
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        pool.cache(b, i.to_bytes(16, "little"))
    t0 = time.perf_counter_ns()
    pool.free(blocks)
    t1 = time.perf_counter_ns()
    half = blocks[: n // 2]
    pool.touch(half)  # hits: revived from the queues
    t2 = time.perf_counter_ns()
    pool.free(half)  # the hit blocks: to the main queue (2q, s3fifo)
    t3 = time.perf_counter_ns()
    fresh = pool.allocate(n // 2)  # evicts cached blocks
    t4 = time.perf_counter_ns()
    pool.free(fresh)
    return (t4 - t3) / (n // 2), (t2 - t1) / (n // 2), (t1 - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("pool", "engine", "micro", "noreuse"), help="which measurement to run")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "bench_eviction"),
                    help="where the tiny demo engine is built (kept for later runs)")
    ap.add_argument("--seeds", type=int, default=5, help="engine: seeds of the workload to run (each one run)")
    ap.add_argument("--rounds", type=int, default=5, help="micro / noreuse: rounds, variants alternated")
    args = ap.parse_args()
    {"pool": bench_pool, "engine": bench_engine, "micro": bench_micro, "noreuse": bench_noreuse}[args.what](args)


if __name__ == "__main__":
    main()

"""TTFT of a second server on a prefix only the first server has computed, through a shared Redis tier.

    flock /tmp/bench.lock python -m trtprompt.bench.scenarios.tier_redis ENGINE_DIR [--repeats 5] [--prefix-len 960]

Starts its own redis-server (Debian's, on a free loopback port, no persistence) and two engines of
ENGINE_DIR on it, in this process. For each repeat, a fresh random prefix: the first engine serves
prefix + question A (its blocks go to Redis); the second, whose pool has never seen the prefix,
serves prefix + question B ("shared"), then a prefix nobody has seen ("cold", a Redis miss, computed).
The two are measured alternately in one run, so the ratio is from the same conditions; the second
engine's tokens on "shared" are checked against an engine without tiers. Prints a Markdown table
and writes JSON to --out. docs/prefix-pool.md, "Remote tier".
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from trtprompt.bench import machine
from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.request import RequestOutput, SamplingParams
from trtprompt.serve.ports import free_ports

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)


def start_redis(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Debian's redis-server on a free loopback port, no persistence, answering PING; its URL."""
    server = shutil.which("redis-server")
    if server is None:
        sys.exit("redis-server is not installed (Debian: apt-get install redis-server, done by `make install`)")
    (port,) = free_ports(1)
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(root), "--maxmemory", "4gb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.RedisError:
            if time.monotonic() > deadline:
                sys.exit("redis-server did not answer PING within 30 s")
            time.sleep(0.05)


def serve_one(engine: LLMEngine, rid: str, ids: list[int]) -> tuple[float, list[int], RequestOutput]:
    """TTFT in seconds (arrival to first token, the engine's own timestamps), tokens, final output."""
    engine.add_request(rid, ids, PARAMS)
    tokens: list[int] = []
    while True:
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                stats = out.stats
                if out.error is not None or stats.first_token_time_ns is None:
                    raise RuntimeError(f"request {rid} failed: {out.error}")
                return (stats.first_token_time_ns - stats.arrival_time_ns) / 1e9, tokens, out


def settle(engine: LLMEngine) -> None:
    """Let the writer finish, so writes to Redis do not overlap the next measurement."""
    if engine.kv.tiers is None:
        raise RuntimeError("the engine has no KV tier")
    for writer in engine.kv.tiers.writers:
        writer.join()


def one_repeat(i: int, engines: tuple[LLMEngine, LLMEngine, LLMEngine], tokens: Callable[[int], list[int]],
               prefix_len: int, question_len: int) -> dict[str, Any]:
    """The first engine serves a new prefix; the second serves it shared (from Redis) and then cold."""
    first, second, plain = engines
    prefix = tokens(prefix_len)
    serve_one(first, f"a{i}", prefix + tokens(question_len))
    settle(first)
    question = tokens(question_len)
    shared_s, got, out = serve_one(second, f"b{i}", prefix + question)
    settle(second)
    cold_s, _, cold_out = serve_one(second, f"c{i}", tokens(prefix_len) + question)
    settle(second)
    _, want, _ = serve_one(plain, f"p{i}", prefix + question)
    if got != want:
        raise RuntimeError(f"repeat {i}: the shared prefix changed the greedy tokens")
    return {"shared_ttft_s": shared_s, "cold_ttft_s": cold_s,
            "shared_reused_blocks": out.stats.kv_cache_reused_blocks,
            "cold_reused_blocks": cold_out.stats.kv_cache_reused_blocks}


def measure(args: argparse.Namespace, url: str) -> tuple[list[dict[str, Any]], Any, list[float], int]:
    """The repeats' rows, the second engine's Redis tier stats, its loader's seconds, tokens per block."""
    rng = torch.Generator().manual_seed(0)
    engines = (LLMEngine.from_engine_dir(args.engine_dir, kv_remote_url=url),
               LLMEngine.from_engine_dir(args.engine_dir, kv_remote_url=url),
               LLMEngine.from_engine_dir(args.engine_dir))
    vocab = engines[0].model_config.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=rng).tolist()

    for engine in engines:  # warm-up: kernels, allocator, Redis connections
        serve_one(engine, "warm", tokens(args.prefix_len + args.question_len))
        if engine is not engines[2]:
            settle(engine)
    rows = [one_repeat(i, engines, tokens, args.prefix_len, args.question_len) for i in range(args.repeats)]
    second = engines[1]
    (snap,) = second.stats().kv_tiers
    if second.kv.tiers is None:
        raise RuntimeError("the second engine has no KV tier")
    loads = list(second.kv.tiers.stats.load_seconds)  # the loader's time per job, hits and misses
    for engine in engines:
        engine.close()
    return rows, snap, loads, second.config.kv_cache.tokens_per_block


def print_table(rows: list[dict[str, Any]], shared: float, cold: float, snap: Any, loads: list[float]) -> None:
    print("| repeat | shared TTFT (s) | cold TTFT (s) | reused blocks (shared / cold) |")
    print("| --- | --- | --- | --- |")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['shared_ttft_s']:.4f} | {r['cold_ttft_s']:.4f} | "
              f"{r['shared_reused_blocks']} / {r['cold_reused_blocks']} |")
    print(f"\nmedian shared {shared:.4f} s, cold {cold:.4f} s: ratio {shared / cold:.3f} "
          f"(target <= 0.35); Redis bytes read {snap.bytes_read:,}, errors {snap.errors}; loader job seconds "
          f"(hits and misses) {', '.join(f'{x:.3f}' for x in loads)}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefix-len", type=int, default=960)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench-results/tier_redis.json"))
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(Path(tmp))
        try:
            rows, snap, loads, tpb = measure(args, url)
        finally:
            proc.terminate()
            proc.wait(30)
    shared = statistics.median(r["shared_ttft_s"] for r in rows)
    cold = statistics.median(r["cold_ttft_s"] for r in rows)
    result = {"engine": str(args.engine_dir), "prefix_len": args.prefix_len, "question_len": args.question_len,
              "tokens_per_block": tpb, "threads": args.threads, "rows": rows, "median_shared_ttft_s": shared,
              "median_cold_ttft_s": cold, "ratio": shared / cold, "load_seconds": loads,
              "redis_tier": {"hit_blocks": snap.hit_blocks, "misses": snap.misses, "bytes_read": snap.bytes_read,
                             "errors": snap.errors, "corrupt": snap.corrupt}, "machine": machine.describe()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2), encoding="utf-8")
    print_table(rows, shared, cold, snap, loads)


if __name__ == "__main__":
    main()

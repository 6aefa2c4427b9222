"""serve --replicas 2 behind sglang-router's cache-aware policy vs round-robin over the same replicas
(issue 25's targets; docs/replicas.md, "Measurements").

One `trtprompt serve ENGINE --replicas 2` (each replica on one core, one engine thread). Then, each
phase with its own system prompts (so every phase starts on cold pools):

  single       every request straight to replica 0's front end: one server, one pool;
  cache_aware  through the group's router (sglang-router, cache_aware);
  round_robin  through a second sglang-router, --policy round_robin, over the same two replicas;
  overhead     a short prompt, direct to a replica vs through the cache-aware router, interleaved
               (trtprompt/bench/router_overhead.py, as `trtprompt bench --replicas-file` measures it).

--failover instead: 4 clients loop short chats through the router while a replica's engine process
is SIGKILLed 5 times (alternating replicas; each time, how long from the engine answering again to
the router calling the replica healthy), then SIGHUP runs a rolling restart; every outcome counted.

Hit rate: hit_tokens / queried_tokens over the phase, summed over the replicas' engines (their own
stats op: trtprompt/bench/replica_group.py, shared with `trtprompt bench --replicas-file`). TTFT:
streamed chat completion, time to the first chunk with text. Run it under the bench
lock: flock /tmp/bench.lock .venv/bin/python scripts/bench_replicas.py ENGINE
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trtprompt.bench.replica_group import Replica, engine_counts, read_group, replica_rows  # noqa: E402
from trtprompt.bench.router_overhead import router_overhead  # noqa: E402
from trtprompt.serve.launch import router as R  # noqa: E402
from trtprompt.serve.ports import free_ports  # noqa: E402
from trtprompt.serve.wire import protocol as P  # noqa: E402

WORDS = ("ship order invoice parcel route depot carrier customs weight label pallet freight port "
         "delivery window priority return refund damage claim tracking address postcode signature").split()


def system_prompts(tokenizer: Any, count: int, tokens: int, seed: int) -> list[str]:
    """count distinct texts of about `tokens` tokens each (random words, seeded)."""
    rng, out = random.Random(seed), []
    for i in range(count):
        words = [f"Policy {seed}-{i}:"]
        while len(tokenizer.encode(" ".join(words))) < tokens:
            words += rng.choices(WORDS, k=32)
        out.append(" ".join(words))
    return out


def ttft(base: str, model: str, system: str | None, user: str, max_tokens: int) -> float:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    start = time.perf_counter()
    first = None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                                                temperature=0, stream=True):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def phase(base: str, model: str, prompts: list[str], users: int, concurrency: int,
          replicas: Sequence[Replica]) -> dict[str, Any]:
    before = [engine_counts(r) for r in replicas]
    jobs = [(p, f"User {u}: where is my parcel number {1000 + u}?") for u in range(users) for p in prompts]
    # Arrivals in a seeded random order: in a fixed order round-robin would line prompts up with replicas.
    random.Random(len(jobs)).shuffle(jobs)
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        times = list(pool.map(lambda j: ttft(base, model, j[0], j[1], 4), jobs))
    wall = time.perf_counter() - start
    rows = replica_rows(before, [engine_counts(r) for r in replicas])
    hits, queried = sum(r["hit_tokens"] for r in rows), sum(r["queried_tokens"] for r in rows)
    return {"requests": len(jobs), "ttft_p50_s": statistics.median(times), "ttft_mean_s": statistics.fmean(times),
            "wall_s": wall, "hit_rate": hits / max(1, queried), "per_replica": rows}


class Load:
    """clients threads sending short chats through base until stop(); outcomes counted."""

    def __init__(self, base: str, model: str, clients: int = 4) -> None:
        self.base, self.model, self._stop = base, model, threading.Event()
        self.outcomes: list[tuple[str, float]] = []
        self._threads = [threading.Thread(target=self._loop, args=(k,)) for k in range(clients)]
        for t in self._threads:
            t.start()

    def _loop(self, k: int) -> None:
        client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=60)
        i = 0
        while not self._stop.is_set():
            i += 1
            start = time.perf_counter()
            try:
                client.chat.completions.create(model=self.model, max_tokens=16, temperature=0, messages=[
                    {"role": "system", "content": f"System prompt {k % 3}. " * 30},
                    {"role": "user", "content": f"hi {k} {i}"}])
                self.outcomes.append(("ok", time.perf_counter() - start))
            except openai.APIStatusError as exc:
                self.outcomes.append((f"{exc.status_code}: {str(exc)[:100]}", time.perf_counter() - start))
            except openai.APIError as exc:
                self.outcomes.append((f"{type(exc).__name__}: {str(exc)[:100]}", time.perf_counter() - start))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        for t in self._threads:
            t.join()
        return {"requests": len(self.outcomes), "outcomes": dict(Counter(o for o, _ in self.outcomes)),
                "max_latency_s": max(d for _, d in self.outcomes)}


def engine_pid(replica: dict[str, Any]) -> int | None:
    try:
        return int(P.call(replica["engine_socket"], {"op": "stats", "since": 1 << 62}, timeout=1.0)["pid"])
    except (P.EngineUnavailableError, P.EngineError):
        return None


def failover(proc: subprocess.Popen[bytes], log: Path, layout: dict[str, Any], model: str) -> dict[str, Any]:
    replicas, rt = layout["replicas"], layout["router"]
    opts = R.RouterOptions("127.0.0.1", int(rt.rsplit(":", 1)[1]), 1)
    load, rejoin = Load(rt, model), []
    for n in range(5):
        time.sleep(2)
        r = replicas[n % 2]
        os.kill(engine_pid(r) or 0, signal.SIGKILL)
        R.wait_until(lambda: engine_pid(r) is not None, "the engine back", 300)
        ready = time.perf_counter()
        R.wait_until(lambda: r["url"] in R.healthy_workers(opts), "the router to take it back", 60)
        rejoin.append(round(time.perf_counter() - ready, 2))
    time.sleep(2)
    kills = load.stop() | {"rejoin_after_ready_s": rejoin}
    load, done = Load(rt, model), log.read_text().count("rolling restart done")
    start = time.perf_counter()
    proc.send_signal(signal.SIGHUP)
    R.wait_until(lambda: log.read_text().count("rolling restart done") > done, "the rolling restart", 600)
    took = time.perf_counter() - start
    time.sleep(2)
    return {"kills": kills, "rolling_restart": load.stop() | {"took_s": round(took, 1)}}


def start_group(engine: Path, run_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    grpc, http, metrics, port = free_ports(4)
    cmd = [sys.executable, "-m", "trtprompt.cli", "serve", str(engine), "--replicas", "2", "--run-dir", str(run_dir),
           "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics),
           "--openai-port", str(port), "--ready-timeout", "600"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 900
    while "trtprompt serve: ready" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve did not become ready:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    return proc, port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", type=Path)
    ap.add_argument("--prompts", type=int, default=4, help="system prompts per phase")
    ap.add_argument("--users", type=int, default=6, help="users per system prompt")
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--overhead-requests", type=int, default=30)
    ap.add_argument("--run-dir", type=Path, default=Path("/tmp/bench-replicas"))
    ap.add_argument("--failover", action="store_true", help="5 engine kills and a rolling restart under load")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.engine / "tokenizer"))
    args.run_dir.mkdir(parents=True, exist_ok=True)
    proc, port = start_group(args.engine, args.run_dir / "run", args.run_dir / "serve.log")
    rr_proc = None
    try:
        layout = json.loads((args.run_dir / "run" / "replicas.json").read_text())
        group = read_group(args.run_dir / "run" / "replicas.json")
        replicas, routed = group.replicas, group.router
        model = openai.OpenAI(base_url=f"{routed}/v1", api_key="unused").models.list().data[0].id
        if args.failover:
            print(json.dumps(failover(proc, args.run_dir / "serve.log", layout, model), indent=2))
            return
        rr_port, rr_metrics = free_ports(2)
        rr = R.RouterOptions("127.0.0.1", rr_port, rr_metrics, policy="round_robin")
        rr_proc = subprocess.Popen(R.router_command(rr, [r.url for r in replicas]),
                                   stdout=(args.run_dir / "rr.log").open("wb"), stderr=subprocess.STDOUT)
        R.wait_until(lambda: len(R.healthy_workers(rr)) == len(replicas), "the round-robin router", 120)
        results: dict[str, Any] = {"engine": str(args.engine), "prompts": args.prompts, "users": args.users,
                                   "prefix_tokens": args.prefix_tokens, "concurrency": args.concurrency}
        bases = {"single": replicas[0].url, "cache_aware": routed, "round_robin": rr.base}
        for seed, (name, base) in enumerate(bases.items()):
            prompts = system_prompts(tokenizer, args.prompts, args.prefix_tokens, seed)
            results[name] = phase(base, model, prompts, args.users, args.concurrency,
                                  replicas if name != "single" else replicas[:1])
            print(name, json.dumps(results[name]), flush=True)
        results["overhead"] = router_overhead(group, args.overhead_requests, model)
        single_rate = results["single"]["hit_rate"]  # 0 when every prompt was seen once (nothing to reuse)
        results["hit_rate_vs_single"] = results["cache_aware"]["hit_rate"] / single_rate if single_rate else None
        results["ttft_p50_vs_round_robin"] = (results["cache_aware"]["ttft_p50_s"]
                                             / results["round_robin"]["ttft_p50_s"])
        print(json.dumps(results, indent=2))
    finally:
        if rr_proc is not None:
            rr_proc.terminate()
            rr_proc.wait(30)
        proc.send_signal(signal.SIGINT)
        proc.wait(120)


if __name__ == "__main__":
    main()

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
lock: flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.replicas ENGINE
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
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from trtprompt.bench import machine
from trtprompt.bench.openai_client import served_model
from trtprompt.bench.replica_group import Replica, ReplicaGroup, engine_counts, read_group, replica_rows
from trtprompt.bench.router_overhead import router_overhead
from trtprompt.bench.scenarios._serve import serve_argv, start_serve
from trtprompt.serve.launch import router as R
from trtprompt.serve.ports import free_ports
from trtprompt.serve.wire import protocol as P

WORDS = ("ship order invoice parcel route depot carrier customs weight label pallet freight port "
         "delivery window priority return refund damage claim tracking address postcode signature").split()


def system_prompts(tokenizer: Any, count: int, tokens: int, seed: int) -> list[str]:
    """count distinct texts of about `tokens` tokens each (random words, seeded)."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(count):
        words = [f"Policy {seed}-{i}:"]
        while len(tokenizer.encode(" ".join(words))) < tokens:
            words += rng.choices(WORDS, k=32)
        out.append(" ".join(words))
    return out


def ttft(base: str, model: str, system: str | None, user: str, max_tokens: int) -> float:
    """Seconds to the first streamed chunk with text of one chat completion (the official openai client)."""
    import openai  # here, not at the top: the module answers --help without its second of imports

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
    messages: Any = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    start = time.perf_counter()
    first = None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
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
        import openai

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


def start_group(engine: Path, run_dir: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`serve ENGINE --replicas 2` on free ports, ready; extra: more serve options (the routers add KV events)."""
    grpc, http, metrics, port = free_ports(4)
    argv = serve_argv(engine, run_dir, (grpc, http, metrics), "--replicas", "2", "--openai-port", str(port),
                      "--ready-timeout", "600", *extra)
    return start_serve(argv, log, 900, poll_s=0.5)


def stop_process(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
    if proc is not None:
        proc.send_signal(sig)
        proc.wait(timeout_s)


def round_robin_router(replicas: Sequence[Replica], log: Path) -> tuple[R.RouterOptions, subprocess.Popen[bytes]]:
    """A second sglang-router, --policy round_robin, over the same replicas; healthy when returned."""
    rr_port, rr_metrics = free_ports(2)
    rr = R.RouterOptions("127.0.0.1", rr_port, rr_metrics, policy="round_robin")
    proc = subprocess.Popen(R.router_command(rr, [r.url for r in replicas]), stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)
    try:
        R.wait_until(lambda: len(R.healthy_workers(rr)) == len(replicas), "the round-robin router", 120)
    except BaseException:
        stop_process(proc)
        raise
    return rr, proc


def phases(args: argparse.Namespace, group: ReplicaGroup, model: str, rr_base: str) -> dict[str, Any]:
    """single, cache_aware, round_robin and the router's overhead, with the ratios issue 25 asks for."""
    tokenizer = hf_tokenizer(args.engine)
    results: dict[str, Any] = {"engine": str(args.engine), "prompts": args.prompts, "users": args.users,
                               "prefix_tokens": args.prefix_tokens, "concurrency": args.concurrency,
                               "machine": machine.describe()}
    replicas = group.replicas
    bases = {"single": replicas[0].url, "cache_aware": group.router, "round_robin": rr_base}
    for seed, (name, base) in enumerate(bases.items()):
        prompts = system_prompts(tokenizer, args.prompts, args.prefix_tokens, seed)
        results[name] = phase(base, model, prompts, args.users, args.concurrency,
                              replicas if name != "single" else replicas[:1])
        print(name, json.dumps(results[name]), flush=True)
    results["overhead"] = router_overhead(group, args.overhead_requests, model)
    single_rate = results["single"]["hit_rate"]  # 0 when every prompt was seen once (nothing to reuse)
    results["hit_rate_vs_single"] = results["cache_aware"]["hit_rate"] / single_rate if single_rate else None
    results["ttft_p50_vs_round_robin"] = results["cache_aware"]["ttft_p50_s"] / results["round_robin"]["ttft_p50_s"]
    return results


def hf_tokenizer(engine: Path) -> Any:
    """The engine's tokenizer as transformers loads it (what the prompts are sized with)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(engine / "tokenizer"))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", type=Path)
    ap.add_argument("--prompts", type=int, default=4, help="system prompts per phase")
    ap.add_argument("--users", type=int, default=6, help="users per system prompt")
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--overhead-requests", type=int, default=30)
    ap.add_argument("--run-dir", type=Path, default=Path("/tmp/bench-replicas"))
    ap.add_argument("--failover", action="store_true", help="5 engine kills and a rolling restart under load")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    run, log = args.run_dir / "run", args.run_dir / "serve.log"
    proc = start_group(args.engine, run, log)
    rr_proc = None
    try:
        group = read_group(run / "replicas.json")
        model = served_model(group.router)
        if args.failover:
            print(json.dumps(failover(proc, log, json.loads((run / "replicas.json").read_text()), model), indent=2))
            return
        rr, rr_proc = round_robin_router(group.replicas, args.run_dir / "rr.log")
        print(json.dumps(phases(args, group, model, rr.base), indent=2))
    finally:
        stop_process(rr_proc)
        stop_process(proc, signal.SIGINT, 120)


if __name__ == "__main__":
    main()

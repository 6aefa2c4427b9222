"""The candidate routers of issue 25 item 1 over the same `serve --replicas 2` group, measured on the
replicas workload (docs/replicas.md, "Why sglang-router").

One `trtprompt serve ENGINE --replicas 2 --kv-events-endpoint tcp://127.0.0.1:PORT` (replica i
publishes vLLM-format KV events on PORT + i), then, over its two replicas, in turn:

  sglang_cache_aware  the group's own router (sglang-router, cache_aware);
  sglang_round_robin  a second sglang-router, --policy round_robin;
  vllm_cache_aware    vllm-router, --policy cache_aware;
  vllm_kv_aware       vllm-router, --policy kv_aware, fed with each replica's KV events
                      (--kv-event-source URL=ENDPOINT, --kv-event-block-size = tokens_per_block);
  vllm_kv_aware_tokenize   the same, each replica behind a TokenizeShim: what kv_aware does once a
                      worker answers vLLM's POST /tokenize, which trtprompt's front end lacks (without
                      it kv_aware has no token ids and scores load only: outcome "missing_tokens");
  vllm_kv_aware_tokenizer  kv_aware with VLLM_ROUTER_TOKENIZER set (0.1.17 uses it on its gRPC path only).

Each router first gets the fronting checks (chat and completions, whole and streamed; /v1/models
names the replicas' model id), then one phase of the replicas scenario's workload with its own
system prompts, so every phase starts on pools that never saw them. Per router: the engines' own hit
rate over the phase, TTFT p50/p90, wall time, errors. vllm-router is not in trtprompt's venv: give
its executable with --vllm-router (a separate venv: python -m venv V && V/bin/pip install
vllm-router==0.1.17). Run it under the bench lock:

  flock /tmp/bench.lock .venv/bin/python -m trtprompt.bench.scenarios.routers ENGINE --vllm-router V/bin/vllm-router
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
import urllib.request
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import SplitResult, urlsplit

from trtprompt.bench import machine
from trtprompt.bench.openai_client import served_model
from trtprompt.bench.replica_group import ReplicaGroup, engine_counts, read_group, replica_rows
from trtprompt.bench.scenarios import replicas as B
from trtprompt.serve.launch import router as R
from trtprompt.serve.ports import free_ports
from trtprompt.tokenizer import Tokenizer

ROUTERS = ("sglang_cache_aware", "sglang_round_robin", "vllm_cache_aware", "vllm_kv_aware", "vllm_kv_aware_tokenize",
           "vllm_kv_aware_tokenizer")


def wait_for(done: Callable[[], bool], proc: subprocess.Popen[bytes], timeout_s: float,
             why: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(why())
        time.sleep(0.5)


def vllm_router_command(exe: str, port: int, metrics: int, policy: str, replicas: list[dict[str, Any]],
                        block_size: int, model: str, log_level: str) -> list[str]:
    """vllm-router 0.1.17 with the same health and breaker settings trtprompt gives sglang-router."""
    cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[r["url"] for r in replicas],
           "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
           "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
           "--health-success-threshold", "1", "--cb-failure-threshold", str(R.CB_FAILURES),
           "--cb-success-threshold", "1", "--cb-timeout-duration-secs", str(R.CB_OPEN_S),
           "--worker-startup-check-interval", "1", "--log-level", log_level]
    if policy == "kv_aware":
        for r in replicas:
            cmd += ["--kv-event-source", f"{r['url']}={r['kv_events_endpoint']}"]
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
    return cmd


class ShimHandler(BaseHTTPRequestHandler):
    """TokenizeShim's requests: POST /tokenize answered here, everything else relayed to `target`."""

    target: SplitResult  # set on the subclass each shim makes
    tok: Tokenizer

    def do_GET(self) -> None:
        self._relay(b"")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path != "/tokenize":
            self._relay(body)
            return
        req = json.loads(body)
        ids = self.tok.encode_chat(req["messages"]) if "messages" in req else self.tok.encode(req["prompt"])
        out = json.dumps({"count": len(ids), "max_model_len": 2048, "tokens": ids}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def _relay(self, body: bytes) -> None:
        conn = HTTPConnection(self.target.hostname or "127.0.0.1", self.target.port or 80, timeout=600)
        conn.request(self.command, self.path, body or None, {"content-type": "application/json"})
        resp = conn.getresponse()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(k, v)
        self.send_header("connection", "close")
        self.end_headers()
        while chunk := resp.read1(65536):
            self.wfile.write(chunk)
            self.wfile.flush()
        conn.close()

    def log_message(self, *args: Any) -> None:
        pass


class TokenizeShim:
    """A bench-only stand-in for the vLLM `POST /tokenize` a replica's front end lacks: answers it
    with the engine's own tokenizer and chat template (vLLM's reply: count, max_model_len, tokens)
    and relays everything else to the replica unchanged (the body close-delimited, so streams flow)."""

    def __init__(self, upstream: str, tokenizer: Tokenizer) -> None:
        handler = type("BoundShimHandler", (ShimHandler,), {"target": urlsplit(upstream), "tok": tokenizer})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def models_ok(base: str) -> bool:
    """The router answers GET /v1/models (200; before its first health check its list may be empty)."""
    try:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def start_router(name: str, args: argparse.Namespace, layout: dict[str, Any], block_size: int, model: str,
                 log: Path) -> tuple[str, subprocess.Popen[bytes] | None]:
    """(base URL, process to stop, None for the group's own router)."""
    replicas = layout["replicas"]
    if name == "sglang_cache_aware":
        return layout["router"], None
    port, metrics = free_ports(2)
    if name == "sglang_round_robin":
        opts = R.RouterOptions("127.0.0.1", port, metrics, policy="round_robin")
        cmd = R.router_command(opts, [r["url"] for r in replicas])
    else:
        if name.endswith("_tokenize"):
            tok = Tokenizer.from_dir(args.engine / "tokenizer")
            replicas = [r | {"url": TokenizeShim(r["url"], tok).url} for r in replicas]
        policy = "cache_aware" if name == "vllm_cache_aware" else "kv_aware"
        cmd = vllm_router_command(args.vllm_router, port, metrics, policy, replicas, block_size, model,
                                  args.vllm_log_level)
    env = {"VLLM_ROUTER_TOKENIZER": str(args.engine / "tokenizer")} if name.endswith("_tokenizer") else {}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, **env})
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: models_ok(base), proc, 120, lambda: f"{name} did not start:\n{log.read_text()[-3000:]}")
    time.sleep(2)  # a router answers /v1/models before its first health check has passed
    return base, proc


def attempt(what: str, call: Callable[[], Any], seen: dict[str, str]) -> None:
    """seen[what]: the call's result, or FAILED and why."""
    import openai  # here, not at the top: the module answers --help without its second of imports

    try:
        seen[what] = str(call())[:160]
    except (openai.APIError, OSError, ValueError, KeyError, IndexError) as exc:
        seen[what] = f"FAILED {type(exc).__name__}: {str(exc)[:300]}"


def fronting(base: str, model: str) -> dict[str, str]:
    """Does the router front trtprompt unchanged? Each call's result, or FAILED and why."""
    import openai

    c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    msgs: Any = [{"role": "user", "content": "Say hi"}]
    seen: dict[str, str] = {}
    attempt("models", lambda: [m.id for m in c.models.list().data], seen)
    attempt("chat", lambda: c.chat.completions.create(model=model, messages=msgs, max_tokens=4,
                                                      temperature=0).choices[0].message.content, seen)
    attempt("chat_stream", lambda: "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=model, messages=msgs, max_tokens=4, temperature=0, stream=True) if ch.choices), seen)
    attempt("completions", lambda: c.completions.create(model=model, prompt="Hello", max_tokens=4,
                                                        temperature=0).choices[0].text, seen)
    attempt("completions_stream", lambda: "".join(ch.choices[0].text for ch in c.completions.create(
        model=model, prompt="Hello", max_tokens=4, temperature=0, stream=True) if ch.choices), seen)
    attempt("completions_token_ids", lambda: c.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=4,
                                                                  temperature=0).choices[0].text, seen)
    seen["models_real_id"] = str(seen["models"] == str([model]))
    return seen


def phase(base: str, model: str, prompts: list[str], args: argparse.Namespace,
          group: ReplicaGroup) -> dict[str, Any]:
    """bench_replicas.phase's workload, with TTFT p90 and the failed requests counted, not raised."""
    before = [engine_counts(r) for r in group.replicas]
    jobs = [(p, f"User {u}: where is my parcel number {1000 + u}?") for u in range(args.users) for p in prompts]
    random.Random(len(jobs)).shuffle(jobs)  # the same arrival order bench_replicas uses

    import openai

    def one(job: tuple[str, str]) -> float | str:
        try:
            return B.ttft(base, model, job[0], job[1], 4)
        except openai.APIError as exc:
            return f"{type(exc).__name__}: {str(exc)[:200]}"

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(args.concurrency) as pool:
        out = list(pool.map(one, jobs))
    wall = time.perf_counter() - start
    rows = replica_rows(before, [engine_counts(r) for r in group.replicas])
    times = sorted(t for t in out if isinstance(t, float))
    hits, queried = sum(r["hit_tokens"] for r in rows), sum(r["queried_tokens"] for r in rows)
    return {"requests": len(jobs), "errors": [e for e in out if isinstance(e, str)][:5],
            "failed": sum(isinstance(e, str) for e in out),
            "ttft_p50_s": statistics.median(times) if times else None,
            "ttft_p90_s": statistics.quantiles(times, n=10)[-1] if len(times) > 1 else None,
            "wall_s": wall, "hit_rate": hits / max(1, queried), "per_replica": rows}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", type=Path)
    ap.add_argument("--vllm-router", default="/work/peers/vllm-router/bin/vllm-router")
    ap.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS[:5]))
    ap.add_argument("--vllm-log-level", default="info", choices=("debug", "info", "warning"))
    ap.add_argument("--prompts", type=int, default=4, help="system prompts per phase")
    ap.add_argument("--users", type=int, default=6, help="users per system prompt")
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--events-port", type=int, default=None, help="replica i publishes on this + i (default: free)")
    ap.add_argument("--run-dir", type=Path, default=Path("/tmp/bench-routers"))
    return ap.parse_args()


def one_router(name: str, seed: int, args: argparse.Namespace, layout: dict[str, Any], group: ReplicaGroup,
               block_size: int, model: str, tokenizer: Any) -> dict[str, Any]:
    """Starts router `name`, checks its fronting, runs its phase, stops it."""
    base, rproc = start_router(name, args, layout, block_size, model, args.run_dir / f"{name}.log")
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
        prompts = B.system_prompts(tokenizer, args.prompts, args.prefix_tokens, 100 + seed)
        return {"fronting": fronting(base, model), "loadavg_before": load,
                **phase(base, model, prompts, args, group)}
    finally:
        B.stop_process(rproc)


def main() -> None:
    args = parse_args()
    tokenizer = B.hf_tokenizer(args.engine)
    block_size = json.loads((args.engine / "trtprompt.json").read_text())["profile"]["tokens_per_block"]
    args.run_dir.mkdir(parents=True, exist_ok=True)
    events_port = args.events_port or free_ports(1)[0]
    run = args.run_dir / "run"
    proc = B.start_group(args.engine, run, args.run_dir / "serve.log",
                         "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}")
    try:
        layout = json.loads((run / "replicas.json").read_text())  # + each kv_events_endpoint
        group = read_group(run / "replicas.json")
        model = served_model(layout["router"])
        results: dict[str, Any] = {"engine": str(args.engine), "model": model, "block_size": block_size,
                                   "prompts": args.prompts, "users": args.users, "concurrency": args.concurrency,
                                   "machine": machine.describe()}
        for seed, name in enumerate(args.routers):
            results[name] = one_router(name, seed, args, layout, group, block_size, model, tokenizer)
            print(name, json.dumps(results[name]), flush=True)
        print(json.dumps(results, indent=2))
    finally:
        B.stop_process(proc, signal.SIGINT, 120)


if __name__ == "__main__":
    main()

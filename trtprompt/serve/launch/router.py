"""sglang-router (SGLang Model Gateway, `sglang-router` on PyPI) in front of the replicas' OpenAI
front ends: its cache-aware policy sends a request to the replica whose approximate prefix tree
matches most of its text, its health checks and retries take a dead replica out, and its
/workers API takes a replica out and back in for a rolling restart. Why this router and what
its flags mean: docs/replicas.md.

The routing policy is the router's own; this module only starts it, waits for it, and calls
its worker API.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from trtprompt.serve.ports import http_ok

POLICIES = ("cache_aware", "round_robin")
CB_FAILURES = 2  # failed calls to one worker before the router stops sending it requests
CB_OPEN_S = 3  # then how long before it tries that worker again
Spawn = Callable[[Sequence[str], Path], subprocess.Popen[bytes]]


class RouterError(RuntimeError):
    """The router did not come up, or refused a worker call; the message says which."""


@dataclass(frozen=True)
class RouterOptions:
    """How the router is run. health_interval_s and health_failures: a dead replica leaves the
    rotation within about their product (plus the check's timeout); the router also retries a
    request a replica refused (503) on another one."""

    host: str
    port: int
    metrics_port: int
    policy: str = "cache_aware"
    health_interval_s: int = 1
    health_failures: int = 2
    health_timeout_s: int = 2

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("port", "metrics_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"router {name} must be in [1, 65535], got {getattr(self, name)}")
        for name in ("health_interval_s", "health_failures", "health_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"router {name} must be at least 1, got {getattr(self, name)}")

    @property
    def local_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def base(self) -> str:
        return f"http://{self.local_host}:{self.port}"


def router_command(opts: RouterOptions, worker_urls: Sequence[str]) -> list[str]:
    """sglang-router 0.3.2's launcher. --backend stays sglang (its default): the openai backend
    answers /v1/completions with 501 (issue 25). Startup checks run once a second, not every 30.

    The circuit breaker opens after CB_FAILURES failed calls to one worker and half-opens after
    CB_OPEN_S: a retry of a request a dead replica refused (503) is then sent elsewhere (cache_aware
    would pick the same worker again while its circuit is closed), and a restarted replica is
    tried again within seconds, not after the default 60 s (docs/replicas.md, "Failover")."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", opts.host, "--port", str(opts.port),
            "--worker-urls", *worker_urls, "--policy", opts.policy,
            "--prometheus-host", opts.local_host, "--prometheus-port", str(opts.metrics_port),
            "--health-check-interval-secs", str(opts.health_interval_s),
            "--health-failure-threshold", str(opts.health_failures), "--health-success-threshold", "1",
            "--health-check-timeout-secs", str(opts.health_timeout_s),
            "--cb-failure-threshold", str(CB_FAILURES), "--cb-success-threshold", "1",
            "--cb-timeout-duration-secs", str(CB_OPEN_S),
            "--worker-startup-check-interval", "1", "--log-level", "warn"]


def start_router(opts: RouterOptions, worker_urls: Sequence[str], log: Path, spawn: Spawn,
                 timeout_s: float, stopped: Callable[[], bool] = lambda: False) -> subprocess.Popen[bytes]:
    """Spawn the router and wait until every worker is healthy in it (stopped(): give up early)."""
    if importlib.util.find_spec("sglang_router") is None:  # installed with the `replicas` extra
        raise RouterError("serve --replicas needs sglang-router: pip install 'trtprompt[replicas]'")
    proc = spawn(router_command(opts, worker_urls), log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RouterError(f"the router exited with code {proc.returncode} (port {opts.port} taken?); "
                              f"{log}:\n{_tail(log)}")
        if http_ok(f"{opts.base}/readiness") and len(healthy_workers(opts)) == len(worker_urls):
            return proc
        if stopped():
            return proc  # the caller stops it with the rest
        time.sleep(0.2)
    raise RouterError(f"the router was not ready within {timeout_s:.0f}s; {log}:\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(encoding="utf-8", errors="replace")[-3000:] if log.is_file() else ""


def _call(opts: RouterOptions, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(f"{opts.base}{path}", data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5.0) as resp:
            return json.loads(resp.read() or b"null")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RouterError(f"router {method} {path} failed: {exc}") from exc


def workers(opts: RouterOptions) -> list[dict[str, Any]]:
    """The router's workers (url, id, is_healthy, load), from GET /workers."""
    return list(_call(opts, "GET", "/workers").get("workers", []))


def healthy_workers(opts: RouterOptions) -> set[str]:
    try:
        return {w["url"] for w in workers(opts) if w.get("is_healthy")}
    except RouterError:
        return set()


def remove_worker(opts: RouterOptions, url: str) -> None:
    """Take url out of the rotation (DELETE /workers/{id}; the router finishes it in the background,
    so this waits until the worker is no longer listed)."""
    for worker in workers(opts):
        if worker["url"] == url:
            _call(opts, "DELETE", f"/workers/{worker['id']}")
    wait_until(lambda: all(w["url"] != url for w in workers(opts)), f"the router to drop {url}")


def add_worker(opts: RouterOptions, url: str) -> None:
    """Put url back in the rotation (POST /workers) and wait until the router calls it healthy."""
    if all(w["url"] != url for w in workers(opts)):
        _call(opts, "POST", "/workers", {"url": url})
    wait_until(lambda: url in healthy_workers(opts), f"the router to take {url} back")


def wait_until(done: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RouterError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)

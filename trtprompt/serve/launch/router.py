"""sglang-router (SGLang Model Gateway, `sglang-router` on PyPI) in front of the replicas' OpenAI
front ends: its cache-aware policy sends a request to the replica whose approximate prefix tree
matches most of its text, its health checks and retries take a dead replica out, and its
/workers API takes a replica out and back in for a rolling restart. Why this router and what
its flags mean: docs/replicas.md.

The routing policy is the router's own; this module only starts it, waits for it, and calls
its worker API. Its keys (the client API key, the control-plane admin key) never go on a command
line: router_main.py hands them to sglang-router's own RouterArgs in the router's process.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from trtprompt.serve.launch.router_main import write_secrets
from trtprompt.serve.ports import http_ok

POLICIES = ("cache_aware", "round_robin")
CB_FAILURES = 2  # failed calls to one worker before the router stops sending it requests
CB_OPEN_S = 3  # then how long before it tries that worker again
ADMIN_KEY_ENV = "TRTPROMPT_ROUTER_ADMIN_KEY"  # the router's /workers key, when not in a file (docs/multi-node.md)
Spawn = Callable[[Sequence[str], Path], subprocess.Popen[bytes]]


class RouterError(RuntimeError):
    """The router did not come up, or refused a worker call; the message says which."""


class Endpoint(Protocol):
    """A router's address and the key its /workers API takes (None: it is open)."""

    @property
    def base(self) -> str: ...

    @property
    def admin_token(self) -> str | None: ...


@dataclass(frozen=True)
class RouterAPI:
    """A router reached over the network (a server joining it: serve/launch/join.py)."""

    base: str
    admin_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.base.startswith(("http://", "https://")):
            raise ValueError(f"router url must start with http:// or https://, got {self.base!r}")
        object.__setattr__(self, "base", self.base.rstrip("/"))


@dataclass(frozen=True)
class RouterOptions:
    """How the router is run. health_interval_s and health_failures: a dead replica leaves the
    rotation within about their product (plus the check's timeout); the router also retries a
    request a replica refused (503) on another one.

    api_key: clients must send it (401 otherwise, checked by the router), and the router sends it
    to the workers it was started with. admin_key: its /workers API then takes only this key
    (sglang-router's control-plane key, role admin); without one, /workers takes api_key, or is
    open when neither is set (docs/multi-node.md)."""

    host: str
    port: int
    metrics_port: int
    policy: str = "cache_aware"
    health_interval_s: int = 1
    health_failures: int = 2
    health_timeout_s: int = 2
    api_key: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)

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

    @property
    def admin_token(self) -> str | None:
        """What /workers calls send (sglang-router 0.3.2, measured: with control-plane keys only
        the admin key passes; without them, the API key)."""
        return self.admin_key or self.api_key

    @property
    def has_secrets(self) -> bool:
        return self.api_key is not None or self.admin_key is not None


def router_command(opts: RouterOptions, worker_urls: Sequence[str], secrets: Path | None = None,
                   extra: Sequence[str] = ()) -> list[str]:
    """sglang-router 0.3.2's launcher, through router_main (which reads the keys from secrets).
    --backend stays sglang (its default): the openai backend answers /v1/completions with 501
    (issue 25). Startup checks run once a second, not every 30.

    The circuit breaker opens after CB_FAILURES failed calls to one worker and half-opens after
    CB_OPEN_S: a retry of a request a dead replica refused (503) is then sent elsewhere (cache_aware
    would pick the same worker again while its circuit is closed), and a restarted replica is
    tried again within seconds, not after the default 60 s (docs/replicas.md, "Failover").
    extra: more sglang-router flags (a router node's Kubernetes discovery, router_node.py)."""
    if opts.has_secrets and secrets is None:
        raise ValueError("a router with a key needs its secrets file (router_main.write_secrets)")
    head = [sys.executable, "-m", "trtprompt.serve.launch.router_main"]
    head += ["--secrets-file", str(secrets)] if secrets is not None and opts.has_secrets else []
    workers = ["--worker-urls", *worker_urls] if worker_urls else []
    return [*head, "--host", opts.host, "--port", str(opts.port), *workers, "--policy", opts.policy,
            "--prometheus-host", opts.local_host, "--prometheus-port", str(opts.metrics_port),
            "--health-check-interval-secs", str(opts.health_interval_s),
            "--health-failure-threshold", str(opts.health_failures), "--health-success-threshold", "1",
            "--health-check-timeout-secs", str(opts.health_timeout_s),
            "--cb-failure-threshold", str(CB_FAILURES), "--cb-success-threshold", "1",
            "--cb-timeout-duration-secs", str(CB_OPEN_S),
            "--worker-startup-check-interval", "1", "--log-level", "warn", *extra]


def start_router(opts: RouterOptions, worker_urls: Sequence[str], log: Path, spawn: Spawn,
                 timeout_s: float, stopped: Callable[[], bool] = lambda: False,
                 extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Spawn the router and wait until every worker is healthy in it (none: until it answers
    /liveness; its /readiness wants a healthy worker). stopped(): give up early. The keys go
    through a 0600 file beside the log (the run dir, 0700) that the router removes once read."""
    if importlib.util.find_spec("sglang_router") is None:  # installed with the `replicas` extra
        raise RouterError("the router needs sglang-router: pip install 'trtprompt[replicas]'")
    secrets = write_secrets(log.parent, opts.api_key, opts.admin_key) if opts.has_secrets else None
    try:
        proc = spawn(router_command(opts, worker_urls, secrets, extra), log)
        _wait_ready(proc, opts, len(worker_urls), log, timeout_s, stopped)
    finally:
        if secrets is not None:
            secrets.unlink(missing_ok=True)  # read by now, or never to be
    return proc


def _wait_ready(proc: subprocess.Popen[bytes], opts: RouterOptions, expected: int, log: Path, timeout_s: float,
                stopped: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    probe = "/readiness" if expected else "/liveness"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RouterError(f"the router exited with code {proc.returncode} (port {opts.port} taken?); "
                              f"{log}:\n{_tail(log)}")
        if http_ok(f"{opts.base}{probe}") and len(healthy_workers(opts)) >= expected:
            return
        if stopped():
            return  # the caller stops it with the rest
        time.sleep(0.2)
    proc.kill()
    raise RouterError(f"the router was not ready within {timeout_s:.0f}s; {log}:\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(encoding="utf-8", errors="replace")[-3000:] if log.is_file() else ""


def _call(opts: Endpoint, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode("utf-8")
    headers = {"Content-Type": "application/json"}
    if opts.admin_token is not None:
        headers["Authorization"] = f"Bearer {opts.admin_token}"
    req = urllib.request.Request(f"{opts.base}{path}", data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5.0) as resp:
            return json.loads(resp.read() or b"null")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RouterError(f"router {method} {opts.base}{path} failed: {exc}") from exc  # never the key


def workers(opts: Endpoint) -> list[dict[str, Any]]:
    """The router's workers (url, id, is_healthy, load), from GET /workers."""
    return list(_call(opts, "GET", "/workers").get("workers", []))


def healthy_workers(opts: Endpoint) -> set[str]:
    try:
        return {w["url"] for w in workers(opts) if w.get("is_healthy")}
    except RouterError:
        return set()


def remove_worker(opts: Endpoint, url: str, timeout_s: float = 30.0) -> None:
    """Take url out of the rotation (DELETE /workers/{id}; the router finishes it in the background,
    so this waits, up to timeout_s, until the worker is no longer listed)."""
    for worker in workers(opts):
        if worker["url"] == url:
            _call(opts, "DELETE", f"/workers/{worker['id']}")
    wait_until(lambda: all(w["url"] != url for w in workers(opts)), f"the router to drop {url}", timeout_s)


def register_worker(opts: Endpoint, url: str, worker_key: str | None) -> None:
    """POST /workers unless url is listed. worker_key: the router sends it to this worker on every
    call (health checks, /server_info, requests), in place of the client's header (measured)."""
    if all(w["url"] != url for w in workers(opts)):
        _call(opts, "POST", "/workers", {"url": url} | ({"api_key": worker_key} if worker_key else {}))


def add_worker(opts: RouterOptions, url: str) -> None:
    """Put a replica back in the rotation (POST /workers, with the group's key) and wait until the
    router calls it healthy."""
    register_worker(opts, url, opts.api_key)
    wait_until(lambda: url in healthy_workers(opts), f"the router to take {url} back")


def wait_until(done: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RouterError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)

"""`trtprompt router`: sglang-router alone, for servers on other machines to join
(`trtprompt serve ENGINE --join-router URL`, serve/launch/join.py) or for its Kubernetes
discovery to find (docs/multi-node.md). The same router, health checks and circuit breaker as
`serve --replicas` (router.py); it starts with no worker unless given some.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from trtprompt.client import API_KEY_ENV
from trtprompt.serve.launch import router as R
from trtprompt.serve.launch.launcher import PACKAGE_PARENT, spawn_child, stop_on_signals
from trtprompt.serve.launch.process_group import stop_group

LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class Discovery:
    """sglang-router's Kubernetes discovery: pods matching every selector (KEY=VALUE) join on
    port; namespace None watches all (cluster-wide rights)."""

    selectors: tuple[str, ...]
    port: int
    namespace: str | None = None

    def __post_init__(self) -> None:
        if not self.selectors or any("=" not in s or s.startswith("=") for s in self.selectors):
            raise ValueError(f"discovery selectors must be KEY=VALUE, got {list(self.selectors)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"discovery port must be in [1, 65535], got {self.port}")

    def args(self) -> list[str]:
        ns = ["--service-discovery-namespace", self.namespace] if self.namespace else []
        return ["--service-discovery", "--selector", *self.selectors,
                "--service-discovery-port", str(self.port), *ns]


@dataclass(frozen=True)
class NodeOptions:
    router: R.RouterOptions
    worker_urls: tuple[str, ...] = ()
    discovery: Discovery | None = None
    run_dir: Path | None = None  # None: a temporary one, removed at exit

    def __post_init__(self) -> None:
        # Whoever reaches an open /workers can add a worker and so receive users' prompts.
        if self.router.host not in LOOPBACK and self.router.admin_token is None:
            raise ValueError(f"--host {self.router.host} exposes the router's /workers API beyond this machine: "
                             f"set an admin key (--admin-key-file or ${R.ADMIN_KEY_ENV}) or an API key "
                             f"(--api-key-file or ${API_KEY_ENV}) first")


def node_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The router's environment: this package importable, no key variable (they go by file)."""
    env = {k: v for k, v in environ.items() if k not in (API_KEY_ENV, R.ADMIN_KEY_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(PACKAGE_PARENT), env.get("PYTHONPATH", "")] if p)
    return env


def banner(opts: NodeOptions, log: Path) -> str:
    r = opts.router
    lines = [f"trtprompt router: ready (sglang-router, policy {r.policy})",
             f"  router  {r.base}  (metrics http://{r.local_host}:{r.metrics_port}/metrics)",
             f"  workers {r.base}/workers{'  (admin key required)' if r.admin_token else ''}",
             f"  log     {log}",
             f"  join:   trtprompt serve ENGINE --join-router http://THIS_HOST:{r.port} --advertise-url "
             "http://THAT_HOST:OPENAI_PORT"]
    if opts.discovery is not None:
        lines.append(f"  discovery: Kubernetes pods {' '.join(opts.discovery.selectors)} on port {opts.discovery.port}")
    return "\n".join(lines)


def run_router_node(opts: NodeOptions, log: Callable[[str], None], timeout_s: float = 60.0) -> int:
    """Run the router until SIGINT/SIGTERM (0) or its exit (1)."""
    own = opts.run_dir is None
    root = Path(tempfile.mkdtemp(prefix="trtprompt-router-")) if opts.run_dir is None else opts.run_dir
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)  # the secrets file passes through it
    log_path, stop = root / "router.log", threading.Event()
    proc = None
    with stop_on_signals(stop.set):
        try:
            extra = opts.discovery.args() if opts.discovery is not None else []
            proc = R.start_router(opts.router, opts.worker_urls, log_path,
                                  lambda cmd, path: spawn_child(cmd, path, node_env(os.environ)),
                                  timeout_s, stop.is_set, extra)
            log(banner(opts, log_path))
            while not stop.wait(0.25):
                if proc.poll() is not None:
                    log(f"trtprompt router: the router exited with code {proc.returncode}:\n{R._tail(log_path)}")
                    return 1
            return 0
        except R.RouterError as exc:
            log(f"trtprompt router: {exc}")
            return 1
        finally:
            for note in stop_group(proc, "the router", 10.0):
                log(f"trtprompt router: stop: {note}")
            if own:
                shutil.rmtree(root, ignore_errors=True)

"""`trtprompt serve ENGINE --replicas N`: N complete servers (engine process, tritonserver, OpenAI
front end), each on its own cores with its own KV pool, behind sglang-router on the user's OpenAI
port (serve/launch/router.py; docs/replicas.md).

Each replica is the single-server Server of launcher.py, supervised in its own thread: a dead
engine process or tritonserver is restarted by the Server itself, a dead front end by restarting
the whole replica. The router's health checks take a replica out while it cannot answer and put
it back once it does. SIGHUP restarts the replicas one at a time (rolling_restart): out of the
router, drained, restarted, back in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from trtprompt.engine.kv_events import offset_endpoint
from trtprompt.serve.launch import router as R
from trtprompt.serve.launch.cpu_sets import replica_cpu_sets
from trtprompt.serve.launch.launcher import (
    LaunchError,
    Ports,
    Server,
    TritonInstall,
    child_env,
    spawn_child,
    stop_on_signals,
)
from trtprompt.serve.launch.options import ApiKey, EngineInfo, OpenAIOptions, ServeOptions
from trtprompt.serve.launch.process_group import stop_group
from trtprompt.serve.ports import free_ports
from trtprompt.serve.wire import protocol as P

RESTART_BACKOFF_S = 2.0  # between a replica's failed (re)start and the next try
DRAIN_TIMEOUT_S = 120.0  # rolling restart: longest wait for a replica's running requests to end
LAYOUT_FILE = "replicas.json"  # in the run dir: each replica's ports, cores and logs, for tools and tests


@dataclass(frozen=True)
class ReplicaSpec:
    """Where one replica runs: its Triton ports, its front end's port, its cores, its run dir."""

    index: int
    ports: Ports
    openai_port: int
    cpus: frozenset[int]
    run_dir: Path

    @property
    def url(self) -> str:
        """The front end's address, as the router knows the worker."""
        return f"http://{self.ports.local_host}:{self.openai_port}"

    def describe(self) -> dict[str, object]:
        return {"index": self.index, "grpc": self.ports.grpc, "http": self.ports.http,
                "metrics": self.ports.metrics, "openai": self.openai_port, "url": self.url,
                "cpus": sorted(self.cpus), "run_dir": str(self.run_dir),
                "engine_socket": str(self.run_dir / "engine.sock")}


def plan_replicas(count: int, ports: Ports, run_dir: Path, cpu_sets: list[frozenset[int]]) -> list[ReplicaSpec]:
    """Replica 0 takes the user's Triton ports; the others, and every front end, free ones (from one free_ports
    call: ports picked one replica at a time could repeat one released by the previous pick, none bound yet)."""
    specs = []
    chosen = free_ports(4 * len(cpu_sets[:count]))
    for i, cpus in enumerate(cpu_sets[:count]):
        grpc, http, metrics, openai = chosen[4 * i:4 * i + 4]
        own = ports if i == 0 else dataclasses.replace(ports, grpc=grpc, http=http, metrics=metrics)
        specs.append(ReplicaSpec(i, own, openai, cpus, run_dir / f"replica-{i}"))
    return specs


def replica_options(options: ServeOptions, cpus: frozenset[int], index: int = 0) -> ServeOptions:
    """Replica index's options: engine_threads unset becomes its core count (more is refused); KV
    event endpoints are offset by the index (a tcp port + index, an ipc path + _index), as vLLM
    offsets its data-parallel ranks' (docs/kv-events.md)."""
    threads = options.engine_threads
    if threads is not None and threads > len(cpus):
        raise ValueError(f"engine_threads {threads} exceeds the {len(cpus)} core(s) each of {options.replicas} "
                         f"replicas gets: lower --engine-threads or --replicas")
    events, replay = options.kv_events_endpoint, options.kv_events_replay_endpoint
    return dataclasses.replace(options, engine_threads=threads or len(cpus), replicas=1,
                               kv_events_endpoint=None if events is None else offset_endpoint(events, index),
                               kv_events_replay_endpoint=None if replay is None else offset_endpoint(replay, index))


class Replica:
    """One replica's Server, started and kept running by supervise() in its own thread.

    The thread lives as long as the replica: every process of the replica is spawned from it, and
    the launcher's parent-death signal (PR_SET_PDEATHSIG) fires when the spawning thread ends."""

    def __init__(self, spec: ReplicaSpec, make: Callable[[ReplicaSpec], Server], log: Callable[[str], None],
                 restart_on_failure: bool = True) -> None:
        self.spec, self._make, self.log = spec, make, log
        self.restart_on_failure = restart_on_failure
        self.server: Server | None = None
        self.ready = threading.Event()  # set while the current Server is started and watched
        self.settled = threading.Event()  # the first start succeeded or failed
        self.first_error: str | None = None
        self.starts = 0

    def supervise(self, stop: threading.Event) -> None:
        """Start the Server; watch it; when it ends (a child died, or restart() asked), stop it and
        start anew. A failed first start ends the thread (the group then fails to start)."""
        while not stop.is_set():
            if self.server is None and not self._try_start(stop):
                if not self.settled.is_set():
                    self.settled.set()
                    return
                continue
            self.settled.set()
            assert self.server is not None
            code = self.server.watch()
            self.ready.clear()
            self.server.stop()
            self.server = None
            if code != 0 and not stop.is_set():
                if not self.restart_on_failure:  # --no-restart: the group then stops (ReplicaGroup.watch)
                    self.log(f"trtprompt serve: replica {self.spec.index} failed; --no-restart: stopping")
                    return
                self.log(f"trtprompt serve: replica {self.spec.index} failed; restarting it")
        self.settled.set()

    def _try_start(self, stop: threading.Event) -> bool:
        self.server = self._make(self.spec)
        self.starts += 1
        try:
            self.server.start()
        except LaunchError as exc:  # the Server has stopped itself
            self.server = None
            self.first_error = self.first_error or str(exc)
            self.log(f"trtprompt serve: replica {self.spec.index} could not start: {exc}")
            stop.wait(RESTART_BACKOFF_S)
            return False
        if self.starts > 1:
            self.log(f"trtprompt serve: replica {self.spec.index} restarted")
        self.ready.set()
        return True

    def restart(self, timeout_s: float) -> None:
        """Stop this replica's Server and wait until supervise() has a new one ready."""
        self.ready.clear()
        if self.server is not None:
            self.server.request_stop()
        if not self.ready.wait(timeout_s):
            raise LaunchError(f"replica {self.spec.index} was not ready again within {timeout_s:.0f}s")

    def in_flight(self) -> int:
        """Requests the replica's engine holds (running or waiting); 0 when it cannot be asked."""
        try:
            stats = P.call(str(self.spec.run_dir / "engine.sock"), {"op": "stats", "since": 1 << 62}, timeout=2.0)
        except (P.EngineUnavailableError, P.EngineError):
            return 0
        return int(stats.get("in_flight", 0)) + int(stats.get("waiting_requests", 0))


class ReplicaGroup:
    """N replicas and the router in front of them, started and stopped together."""

    def __init__(self, specs: list[ReplicaSpec], make: Callable[[ReplicaSpec], Server], router: R.RouterOptions,
                 run_dir: Path, own_run_dir: bool, ready_timeout_s: float, log: Callable[[str], None],
                 restart: bool = True) -> None:
        self.replicas = [Replica(s, make, log, restart) for s in specs]
        self.router, self.run_dir, self.own_run_dir = router, run_dir, own_run_dir
        self.ready_timeout_s, self.log = ready_timeout_s, log
        self.kv_events: list[str | None] = [None] * len(specs)  # each replica's KV event endpoint, if any
        self.router_proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._rolling = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def router_log(self) -> Path:
        return self.run_dir / "router.log"

    def start(self) -> None:
        """Every replica (in parallel, each from its own thread), then the router; on failure
        everything is stopped."""
        for r in self.replicas:
            thread = threading.Thread(target=r.supervise, args=(self._stop,), name=f"replica-{r.spec.index}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        try:
            for r in self.replicas:
                r.settled.wait()
            failed = [r for r in self.replicas if not r.ready.is_set()]
            if self._stop.is_set() or failed:
                raise LaunchError(failed[0].first_error or "stopped while starting" if failed else
                                  "stopped while starting")
            self.router_proc = R.start_router(self.router, [r.spec.url for r in self.replicas], self.router_log,
                                              self._spawn_router, self.ready_timeout_s, self._stop.is_set)
        except (LaunchError, R.RouterError) as exc:
            self.stop()
            raise LaunchError(str(exc)) from None
        except BaseException:
            self.stop()
            raise
        (self.run_dir / LAYOUT_FILE).write_text(json.dumps(self.layout(), indent=2))

    def _spawn_router(self, cmd: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
        """Like every child (launcher.Server._spawn: environment, own group, parent-death signal),
        unpinned; from the main thread, which lives as long as the group."""
        return spawn_child(cmd, log, child_env(TritonInstall.find(), ""))

    def layout(self) -> dict[str, object]:
        return {"router": self.router.base, "router_metrics": f"http://{self.router.local_host}:"
                f"{self.router.metrics_port}/metrics", "policy": self.router.policy,
                "replicas": [r.spec.describe() | {"kv_events_endpoint": self.kv_events[r.spec.index]}
                             for r in self.replicas]}

    def watch(self) -> int:
        """Until stop (0) or the router exits (1); SIGHUP (request_rolling) runs rolling_restart."""
        while not self._stop.wait(0.25):
            if self.router_proc is not None and self.router_proc.poll() is not None:
                self.log(f"the router exited with code {self.router_proc.returncode}:\n{R._tail(self.router_log)}")
                return 1
            if any(not t.is_alive() for t in self._threads):  # a replica failed under --no-restart
                return 1
            if self._rolling.is_set():
                self._rolling.clear()
                self.rolling_restart()
        return 0

    def request_rolling(self) -> None:
        self._rolling.set()

    def rolling_restart(self) -> None:
        """One replica at a time: out of the router, drained, restarted, back in (docs/replicas.md)."""
        self.log("trtprompt serve: rolling restart")
        for r in self.replicas:
            try:
                R.remove_worker(self.router, r.spec.url)
                self._drain(r)
                r.restart(self.ready_timeout_s)
                R.add_worker(self.router, r.spec.url)
            except (LaunchError, R.RouterError) as exc:  # the router's health checks take it back later
                self.log(f"trtprompt serve: rolling restart of replica {r.spec.index}: {exc}")
                with contextlib.suppress(R.RouterError):
                    R.add_worker(self.router, r.spec.url)
            if self._stop.is_set():
                return
            self.log(f"trtprompt serve: replica {r.spec.index} back in the router")
        self.log("trtprompt serve: rolling restart done")

    def _drain(self, replica: Replica) -> None:
        """Wait until the replica's engine holds no request (those the router sent before it was
        removed), for at most DRAIN_TIMEOUT_S; two zero readings 0.2 s apart count as drained."""
        deadline, zeros = time.monotonic() + DRAIN_TIMEOUT_S, 0
        while zeros < 2 and time.monotonic() < deadline and not self._stop.is_set():
            zeros = zeros + 1 if replica.in_flight() == 0 else 0
            time.sleep(0.2)

    def request_stop(self) -> None:
        self._stop.set()
        for r in self.replicas:
            if r.server is not None:
                r.server.request_stop()

    def stop(self) -> None:
        """The router first (no new requests), then every replica (each drains its own front end)."""
        self.request_stop()
        for note in stop_group(self.router_proc, "the router", 10.0):
            self.log(f"trtprompt serve: stop: {note}")
        self.router_proc = None
        for thread in self._threads:
            thread.join(60.0)
        for r in self.replicas:  # those never supervised (a failed start), or whose thread is stuck
            if r.server is not None:
                r.server.stop()
        if self.own_run_dir:
            import shutil

            shutil.rmtree(self.run_dir, ignore_errors=True)


@contextlib.contextmanager
def rolling_on_sighup(group: ReplicaGroup) -> Iterator[None]:
    previous = signal.signal(signal.SIGHUP, lambda *_: group.request_rolling())
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def ready_message(group: ReplicaGroup, engine: EngineInfo, options: ServeOptions, openai: OpenAIOptions) -> str:
    from trtprompt.serve.launch.frontend import banner as openai_banner

    model = engine.meta["source"].get("model")
    lines = [f"trtprompt serve: ready ({len(group.replicas)} replicas of engine {engine.path.name}"
             f"{f', model {model}' if model else ''}, layout {options.layout}, router sglang-router "
             f"{group.router.policy})",
             f"  router  {group.router.base}  (metrics http://{group.router.local_host}:{group.router.metrics_port}"
             f"/metrics)", f"  logs    {group.run_dir}  (layout in {LAYOUT_FILE}; SIGHUP: rolling restart)"]
    for r in group.replicas:
        s, events = r.spec, group.kv_events[r.spec.index]
        lines.append(f"  replica {s.index}: gRPC {s.ports.host}:{s.ports.grpc}  HTTP {s.ports.http}  metrics "
                     f"{s.ports.metrics}  OpenAI {s.url} (behind the router)  cores {_cores(s.cpus)}"
                     f"{f'  KV events {events}' if events else ''}")
    lines.append(openai_banner(openai, group.router.local_host, model or engine.path.name))
    return "\n".join(lines)


def _cores(cpus: frozenset[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def build_group(engine: EngineInfo, options: ServeOptions, ports: Ports, openai: OpenAIOptions,
                run_dir: Path | None, ready_timeout_s: float, restart: bool,
                log: Callable[[str], None], api_key: ApiKey | None = None) -> ReplicaGroup:
    """The group for serve --replicas N (checks the options first; raises ValueError). api_key: the
    router checks it on every client request and sends it to the replicas, whose front ends check
    it too (docs/replicas.md, "API key")."""
    cpu_sets = replica_cpu_sets(options.replicas)
    per_replica = [replica_options(options, cpus, i) for i, cpus in enumerate(cpu_sets)]
    own = run_dir is None
    root = Path(tempfile.mkdtemp(prefix="trtprompt-serve-")) if run_dir is None else Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)
    specs = plan_replicas(options.replicas, ports, root, cpu_sets)
    router_metrics, = free_ports(1)
    key = api_key.value if api_key is not None else openai.api_key
    router = R.RouterOptions(ports.host, openai.port, router_metrics, api_key=key)
    openai = dataclasses.replace(openai, api_key=key)

    def make(spec: ReplicaSpec) -> Server:
        front = dataclasses.replace(openai, port=spec.openai_port)
        return Server(engine, per_replica[spec.index], spec.ports, run_dir=spec.run_dir,
                      ready_timeout_s=ready_timeout_s, restart_engine=restart, log=log, openai=front,
                      cpus=spec.cpus)
    group = ReplicaGroup(specs, make, router, root, own, ready_timeout_s, log, restart)
    group.kv_events = [o.kv_events_endpoint for o in per_replica]
    return group


def serve_replicas(engine: EngineInfo, options: ServeOptions, ports: Ports, openai: OpenAIOptions | None,
                   run_dir: Path | None, ready_timeout_s: float, restart: bool, log: Callable[[str], None],
                   api_key: ApiKey | None) -> int:
    """Run the group until SIGINT/SIGTERM (or the router dies); returns the exit code."""
    if openai is None:
        raise ValueError("--replicas serves through the router on the OpenAI port: drop --no-openai")
    group = build_group(engine, options, ports, openai, run_dir, ready_timeout_s, restart, log, api_key)
    with stop_on_signals(group.request_stop), rolling_on_sighup(group):
        try:
            group.start()
            log(ready_message(group, engine, options, openai))
            return group.watch()
        except LaunchError as exc:
            log(f"trtprompt serve: {exc}")
            return 1
        finally:
            group.stop()

"""Start and watch the engine process and a real tritonserver.

tritonserver comes from PATH (the NGC container) or, failing that, from the
nvidia-pytriton wheel, set up as docs/design.md ("Triton facts", CPU from pip) says:
a backend directory linking the wheel's Python backend and the stub for
this Python, the venv's bin first on PATH, the interpreter's LIBDIR first
on LD_LIBRARY_PATH.

With an API key, every Triton API but health requires it (restricted_api_args;
docs/security.md), and the python backend's shared memory is made the server
user's alone (protect_shm).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from trtprompt import interface as I
from trtprompt.client import API_KEY_ENV, AUTH_HEADER, bearer
from trtprompt.engine.tiers.redis_store import RedisTarget
from trtprompt.serve.launch.options import ApiKey, EngineInfo, OpenAIOptions, ServeOptions
from trtprompt.serve.launch.process_group import SHM_DIR, remove_shm, stop_group
from trtprompt.serve.launch.repository import RepoContext, write_repository
from trtprompt.serve.launch.router import ADMIN_KEY_ENV
from trtprompt.serve.ports import http_ok
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.wire.process import SOCKET_ENV

PACKAGE_PARENT = Path(__file__).resolve().parents[3]
LOG_TAIL_LINES = 40
# Every API group of Triton 2.51 that runs a model, reads or changes the server, or shows its
# models (`tritonserver --help`); health stays open for load balancers and readiness probes
# (ModelReady is in health too). Metrics are a separate port, not an API group: open.
RESTRICTED_APIS = ("inference", "model-config", "model-repository", "metadata", "shared-memory",
                   "statistics", "trace", "logging")


class LaunchError(RuntimeError):
    """The server could not be started; the message says why (with log tails)."""


@dataclass(frozen=True)
class Ports:
    host: str = I.DEFAULT_HOST
    grpc: int = I.GRPC_PORT
    http: int = I.HTTP_PORT
    metrics: int = I.METRICS_PORT

    def __post_init__(self) -> None:
        for name in ("grpc", "http", "metrics"):
            port = getattr(self, name)
            if not 0 < port < 65536:
                raise ValueError(f"{name} port must be in [1, 65535], got {port}")
        if len({self.grpc, self.http, self.metrics}) != 3:
            raise ValueError(f"grpc, http and metrics ports must differ, got {self.grpc}, {self.http}, {self.metrics}")

    @property
    def local_host(self) -> str:
        """Where this machine reaches the server (a wildcard bind is reached locally)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    bundled: bool  # True: the nvidia-pytriton wheel's binary, which needs the setup below

    @classmethod
    def find(cls) -> "TritonInstall":
        on_path = shutil.which("tritonserver")
        if on_path:
            return cls(Path(on_path), bundled=False)
        root = pytriton_root()
        binary = root / "bin" / "tritonserver"
        if not binary.is_file():
            raise LaunchError("no tritonserver on PATH and none bundled in nvidia-pytriton "
                              f"(looked for {binary}); install nvidia-pytriton==0.7.0")
        return cls(binary, bundled=True)


def pytriton_root() -> Path:
    # Found, not imported: importing pytriton imports its client (aiohttp and more), ~0.5 s of every start.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise LaunchError("nvidia-pytriton is not installed; it provides the CPU tritonserver")
    return Path(spec.origin).resolve().parent / "tritonserver"


def make_backend_dir(run_dir: Path) -> Path:
    """backends/python/ holding links to the wheel's python backend and this Python's stub."""
    root = pytriton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    sources = {
        "libtriton_python.so": root / "backends" / "python" / "libtriton_python.so",
        "triton_python_backend_utils.py": root / "backends" / "python" / "triton_python_backend_utils.py",
        "triton_python_backend_stub": root / "python_backend_stubs" / version / "triton_python_backend_stub",
    }
    target = run_dir / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for name, src in sources.items():
        if not src.exists():
            raise LaunchError(f"nvidia-pytriton lacks {src} (no Python {version} stub?)")
        link = target / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
    return run_dir / "backends"


def child_env(install: TritonInstall, socket_path: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(PACKAGE_PARENT), env.get("PYTHONPATH", "")] if p)
    env[SOCKET_ENV] = socket_path
    env.pop(API_KEY_ENV, None)  # only the front end needs it, and it is handed over explicitly
    env.pop(ADMIN_KEY_ENV, None)  # serve --join-router's router key: only this process's keeper sends it
    if install.bundled:
        # Without it the stub loads the system libpython and every model fails.
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [libdir, env.get("LD_LIBRARY_PATH", "")] if p)
    return env


def restricted_api_args(key: ApiKey) -> list[str]:
    """tritonserver's flags requiring `authorization: Bearer KEY` for RESTRICTED_APIS on both ports.

    Triton 2.51 spells them --http-restricted-api and --grpc-restricted-protocol (it refuses
    --grpc-restricted-api), takes each group at most once, splits at the first ':' and '=' (the
    value may hold a space), and checks the gRPC key as metadata 'triton-grpc-protocol-authorization'.
    The key is then on tritonserver's command line: docs/security.md, "Residual risks".
    """
    spec = f"{','.join(RESTRICTED_APIS)}:{AUTH_HEADER}={bearer(key.value)}"
    return [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]


def triton_command(install: TritonInstall, repo: Path, ports: Ports, backend_dir: Path | None,
                   shm_prefix: str | None = None, api_key: ApiKey | None = None) -> list[str]:
    cmd = [str(install.binary), f"--model-repository={repo}",
           f"--http-address={ports.host}", f"--http-port={ports.http}",
           f"--grpc-address={ports.host}", f"--grpc-port={ports.grpc}",
           f"--metrics-address={ports.host}", f"--metrics-port={ports.metrics}",
           "--exit-timeout-secs=10", "--log-verbose=0"]
    if shm_prefix:  # names the python backend's /dev/shm regions, so stop() can find leftovers
        cmd.append(f"--backend-config=python,shm-region-prefix-name={shm_prefix}")
    if api_key is not None:
        cmd += restricted_api_args(api_key)
    if install.bundled:
        cmd += [f"--backend-directory={backend_dir}", "--disable-auto-complete-config",
                "--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false"]
    return cmd


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return f"({path} was not written)"
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(text[-lines:])


# (process, what it is, its log): a child the watch loop ends the server for when it exits.
Watched = tuple[subprocess.Popen[bytes] | None, str, Path]


def watch_children(stop: threading.Event, children: Callable[[], Sequence[Watched]], period_s: float,
                   log: Callable[[str], None], tick: Callable[[], int | None] = lambda: None) -> int:
    """The one watch loop of both targets: until stop is set (0) or a child exits (1, logged with its
    log's tail); tick runs once per period and may end the loop with its own exit code."""
    while not stop.wait(period_s):
        for proc, what, log_path in children():
            if proc is not None and proc.poll() is not None:
                log(f"{what} exited with code {proc.returncode}:\n{log_tail(log_path)}")
                return 1
        code = tick()
        if code is not None:
            return code
    return 0


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """SIGINT and SIGTERM call stop() inside the block; the previous handlers come back after it."""
    previous = {sig: signal.signal(sig, lambda *_: stop()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: a killed launcher may leave its children running


def _child_setup(cpus: frozenset[int] | None = None) -> None:
    """In the child, before exec: what it creates is its user's alone (the engine socket, any file a
    stub writes), and it dies with the launcher. The python backend's /dev/shm regions ignore the
    umask (measured with 2.51: still 0644 under umask 077; Boost fchmods them), hence protect_shm.
    cpus: the cores a replica's processes run on (serve --replicas; docs/replicas.md, "Cores")."""
    os.umask(0o077)
    if cpus:
        os.sched_setaffinity(0, cpus)
    _die_with_parent()


def spawn_child(cmd: Sequence[str], log_path: Path, env: Mapping[str, str],
                cpus: frozenset[int] | None = None) -> subprocess.Popen[bytes]:
    """A child in its own process group, output appended to log_path, set up by _child_setup. It
    gets SIGTERM when the *thread* that spawned it ends (PR_SET_PDEATHSIG): spawn from a thread
    that lives as long as the child should."""
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(list(cmd), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lambda: _child_setup(cpus), env=dict(env))


SHM_MODE = 0o600


def protect_shm(prefix: str) -> list[Path]:
    """chmod 0600 this server's python-backend regions in /dev/shm, which hold requests' prompts and
    outputs and are created 0644 (world-readable); returns those it changed. Called while tritonserver
    starts and on every watch tick, as stubs (re)create their regions; docs/security.md says what
    the window before it leaves."""
    changed = []
    for region in sorted(SHM_DIR.glob(f"{prefix}*")):
        try:
            if region.stat().st_mode & 0o777 != SHM_MODE:
                region.chmod(SHM_MODE)
                changed.append(region)
        except FileNotFoundError:
            continue  # unlinked meanwhile (a stub restarting, or shutdown)
    return changed


def server_key(api_key: ApiKey | None, openai: OpenAIOptions | None) -> ApiKey | None:
    """The one key of a server: api_key, or the front end's (a front end with a key in front of an
    open Triton would guard nothing). Two different keys are refused."""
    front = ApiKey(openai.api_key) if openai is not None and openai.api_key is not None else None
    if api_key is not None and front is not None and api_key != front:
        raise ValueError("the OpenAI front end's API key differs from the server's: one key guards both")
    return api_key or front


class Server:
    """The engine process + tritonserver for one engine directory."""

    def __init__(self, engine: EngineInfo, options: ServeOptions, ports: Ports,
                 run_dir: Path | None = None, ready_timeout_s: float = 120.0,
                 restart_engine: bool = True, log: Callable[[str], None] = print,
                 openai: OpenAIOptions | None = None, api_key: ApiKey | None = None,
                 cpus: frozenset[int] | None = None) -> None:
        self.engine, self.options, self.ports = engine, options, ports
        self.cpus = cpus  # None: every core this process may use (one replica of several: its own)
        self.api_key = server_key(api_key, openai)  # None: every port open (docs/security.md)
        # The OpenAI front end (trtprompt.serve.openai), started after tritonserver, with the same key.
        self.openai = openai if openai is None or self.api_key is None else \
            dataclasses.replace(openai, api_key=self.api_key.value)
        self.openai_proc: subprocess.Popen[bytes] | None = None
        self.ready_timeout_s, self.restart_engine, self.log = ready_timeout_s, restart_engine, log
        self._own_run_dir = run_dir is None
        self.run_dir = Path(tempfile.mkdtemp(prefix="trtprompt-serve-")) if run_dir is None else Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)  # the engine socket accepts any local process that can reach it
        self.socket_path = str(self.run_dir / "engine.sock")
        self.repo = self.run_dir / "repository"
        self.install = TritonInstall.find()
        self.engine_proc: subprocess.Popen[bytes] | None = None
        self.triton_proc: subprocess.Popen[bytes] | None = None
        # Unique per server: what stop() unlinks from /dev/shm is only ever this server's.
        self.shm_prefix = f"trtprompt_{os.getpid()}_{self.run_dir.name.replace('-', '_')}_"
        self.engine_restarts = 0
        self.triton_restarts = 0
        self._stop = threading.Event()

    @property
    def engine_log(self) -> Path:
        return self.run_dir / "engine.log"

    @property
    def triton_log(self) -> Path:
        return self.run_dir / "tritonserver.log"

    def write_repository(self) -> Path:
        return write_repository(self.repo, RepoContext(self.engine, self.options, self.socket_path))

    def _spawn(self, cmd: Sequence[str], log_path: Path,
               extra_env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        env = child_env(self.install, self.socket_path) | dict(extra_env or {})
        return spawn_child(cmd, log_path, env, self.cpus)

    def start_engine(self) -> None:
        # A restart is counted before it is started: the engine reports the count on /metrics.
        cmd = [sys.executable, "-m", "trtprompt.serve.engine_process",
               "--repository", str(self.repo), "--socket", self.socket_path,
               "--restarts", str(self.engine_restarts)]
        self.engine_proc = self._spawn(cmd, self.engine_log)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.engine_proc.poll() is not None:
                raise LaunchError(f"the engine process exited with code {self.engine_proc.returncode}; "
                                  f"{self.engine_log}:\n{log_tail(self.engine_log)}")
            try:
                P.call(self.socket_path, {"op": "info"}, timeout=1.0)
                return
            except (P.EngineUnavailableError, P.EngineError):
                time.sleep(0.1)
        raise LaunchError(f"the engine process was not ready within {self.ready_timeout_s:.0f}s; "
                          f"{self.engine_log}:\n{log_tail(self.engine_log)}")

    def start_triton(self) -> None:
        backend_dir = make_backend_dir(self.run_dir) if self.install.bundled else None
        cmd = triton_command(self.install, self.repo, self.ports, backend_dir, self.shm_prefix, self.api_key)
        self.triton_proc = self._spawn(cmd, self.triton_log)
        # Health (ModelReady included) stays open with a key: these probes need no header.
        base = f"http://{self.ports.local_host}:{self.ports.http}/v2"
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            protect_shm(self.shm_prefix)  # as soon as each stub has made its region
            if self.triton_proc.poll() is not None:
                raise LaunchError(f"tritonserver exited with code {self.triton_proc.returncode}; "
                                  f"{self.triton_log}:\n{log_tail(self.triton_log)}")
            if http_ok(f"{base}/health/ready") and all(
                    http_ok(f"{base}/models/{m}/ready") for m in self.model_names()):
                protect_shm(self.shm_prefix)
                return
            time.sleep(0.2)
        raise LaunchError(f"tritonserver's models were not ready within {self.ready_timeout_s:.0f}s; "
                          f"{self.triton_log}:\n{log_tail(self.triton_log)}")

    def start_openai(self) -> None:
        if self.openai is None:
            return
        from trtprompt.serve.launch.frontend import DirectEngine, FrontendError, start_frontend

        # Fused layout: OpenAI requests skip tritonserver and the stub (docs/design.md, "Serving path").
        direct = DirectEngine(self.socket_path, self.engine.tokenizer_dir) if self.options.layout == "fused" else None
        # The front end's Triton channel reads the key from its environment (to_triton.TritonEnsemble).
        key_env = {API_KEY_ENV: self.api_key.value} if self.api_key is not None else {}
        try:
            self.openai_proc = start_frontend(self.openai, self.engine.path, self.ports.host, self.ports.local_host,
                                              self.ports.grpc, self.run_dir,
                                              lambda cmd, log: self._spawn(cmd, log, key_env), self.ready_timeout_s,
                                              direct)
        except FrontendError as exc:
            raise LaunchError(str(exc)) from None

    def model_names(self) -> list[str]:
        return sorted(p.parent.name for p in self.repo.glob("*/config.pbtxt"))

    def start(self) -> None:
        """Repository, engine process, tritonserver; on failure everything is stopped."""
        try:
            self.write_repository()
            self.start_engine()
            self.start_triton()
            self.start_openai()
        except BaseException:
            self.stop()
            raise

    def watch(self) -> int:
        """Block until stop() or a fatal failure; restart a dead engine process or tritonserver. Returns the exit
        code."""
        return watch_children(self._stop, lambda: [
            (self.openai_proc, "the OpenAI front end", self.run_dir / "openai.log")], 0.25, self.log,
            self._tick)

    def _tick(self) -> int | None:
        protect_shm(self.shm_prefix)  # a restarted stub makes its region anew, 0644
        code = self._restart_dead_engine()
        return self._restart_dead_triton() if code is None else code

    def _restart(self, died: str, start: Callable[[], None]) -> int | None:
        """After a child died (logged as `died`): 1 under --no-restart or where start() fails, else None."""
        self.log(died)
        if not self.restart_engine:
            self.log("--no-restart: stopping the server")
            return 1
        try:
            start()
        except LaunchError as exc:
            self.log(str(exc))
            return 1
        return None

    def _restart_dead_engine(self) -> int | None:
        """None while the engine process runs (or was restarted); 1 if it cannot be."""
        if self.engine_proc is None or self.engine_proc.poll() is None:
            return None

        def start() -> None:
            self.engine_restarts += 1  # before it starts: the engine reports the count on /metrics
            self.start_engine()
            self.log(f"engine process restarted (pid {self.engine_proc.pid if self.engine_proc else None})")

        return self._restart(f"the engine process died (exit code {self.engine_proc.returncode}); requests get "
                             "UNAVAILABLE meanwhile", start)

    def _restart_dead_triton(self) -> int | None:
        """None while tritonserver runs (or was restarted); 1 if it cannot be. tritonserver 2.51 can abort in
        gRPC core while many streams are cancelled at once (docs/design.md, "Triton restart"); the engine
        and its KV cache live in another process, so Triton alone starts again, on the same ports."""
        proc = self.triton_proc
        if proc is None or proc.poll() is None:
            return None

        def start() -> None:
            # Its python-backend stubs may outlive it for a moment; their regions would clash with the new ones.
            for note in stop_group(proc, "tritonserver", 5.0) + remove_shm(self.shm_prefix):
                self.log(f"trtprompt serve: {note}")
            self.triton_restarts += 1
            self.start_triton()
            pid = self.triton_proc.pid if self.triton_proc is not None else None
            self.log(f"tritonserver restarted (pid {pid}; restart {self.triton_restarts})")

        return self._restart(f"tritonserver exited with code {proc.returncode}; gRPC and HTTP are down meanwhile:\n"
                             f"{log_tail(self.triton_log)}", start)

    def request_stop(self) -> None:
        self._stop.set()

    def stop(self) -> None:
        """Triton first (it drains the models), then the engine; no process of any child's group
        and no /dev/shm region of Triton's python backend is left; what had to be killed or
        removed is logged (trtprompt.serve.launch.process_group)."""
        from trtprompt.serve.launch.frontend import remove_key

        self._stop.set()
        notes = stop_group(self.openai_proc, "the OpenAI front end", 10.0)
        remove_key(self.run_dir)  # already gone once the front end started; not after a failed start
        notes += stop_group(self.triton_proc, "tritonserver", 20.0)
        notes += stop_group(self.engine_proc, "the engine process", 10.0)
        notes += remove_shm(self.shm_prefix)
        for note in notes:
            self.log(f"trtprompt serve: stop: {note}")
        self.openai_proc = self.triton_proc = self.engine_proc = None
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _cli_name() -> str:
    """How this shell can run the trtprompt command (e.g. .venv/bin/trtprompt)."""
    exe = Path(sys.executable).parent / "trtprompt"
    if shutil.which("trtprompt") == str(exe) or not exe.is_file():
        return "trtprompt"
    rel = os.path.relpath(exe)
    return rel if not rel.startswith("..") else str(exe)


def tier_lines(opts: ServeOptions) -> list[str]:
    """The banner's KV tier lines (docs/prefix-pool.md); none without tiers."""
    lines = []
    if opts.disk_cache_path is not None:
        lines.append(f"  KV disk {opts.disk_cache_path} (up to {opts.disk_cache_size / 2**30:.1f} GiB, "
                     f"{opts.kv_tier_write_policy}; kept across restarts)")
    if opts.kv_remote_url is not None:
        label = RedisTarget.parse(opts.kv_remote_url).label  # never a password (options.py refuses one)
        lines.append(f"  KV remote {label} ({opts.kv_tier_write_policy}; shared by servers)")
    return lines


def ready_message(server: Server) -> str:
    """What serve prints once everything answers: addresses, logs, a first command."""
    from trtprompt.serve.launch.frontend import banner as openai_banner

    p = server.ports
    model = server.engine.meta["source"].get("model")  # the model's own name (trtprompt.json), when known
    lines = [f"trtprompt serve: ready (engine {server.engine.path.name}{f', model {model}' if model else ''}, "
             f"layout {server.options.layout})",
             f"  gRPC    {p.host}:{p.grpc}", f"  HTTP    {p.host}:{p.http}",
             f"  metrics http://{p.local_host}:{p.metrics}/metrics", f"  logs    {server.run_dir}"]
    if server.api_key is not None:
        lines.append(f"  key     required on gRPC and HTTP but health (/metrics stays open); trtprompt's "
                     f"clients read ${API_KEY_ENV} (docs/security.md)")
    lines += tier_lines(server.options)
    lines.append(f"  try:    {_cli_name()} infer \"Hello\" --url {p.local_host}:{p.grpc}")
    if server.openai:
        lines.append(openai_banner(server.openai, p.local_host, server.engine.path.name))
    return "\n".join(lines)


def serve_forever(server: Server) -> int:
    """Run until SIGINT/SIGTERM (or a fatal failure); returns the exit code."""
    with stop_on_signals(server.request_stop):
        try:
            server.start()
            server.log(ready_message(server))
            return server.watch()
        except LaunchError as exc:
            server.log(f"trtprompt serve: {exc}")
            return 1
        finally:
            server.stop()

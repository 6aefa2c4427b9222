"""The command line that starts Triton for a TensorRT-LLM engine.

World size 1: `tritonserver` directly. More ranks (tp x pp): one tritonserver
per rank under MPI, in mpirun's multi-program form (`-n 1 <rank 0 args> :
-n 1 <rank 1 args> : ...`) because the ranks take different arguments: rank 0
loads the whole repository and serves clients; every other rank only hosts a
tensorrtllm worker (`--model-control-mode=explicit --load-model=tensorrt_llm`).
Each rank gets its own python-backend shared-memory prefix so the ranks'
python models (pre/postprocessing) do not collide.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from trtprompt import interface as I
from trtprompt.serve.launch.launcher import LaunchError, Ports, log_tail, stop_on_signals, watch_children
from trtprompt.serve.launch.options import EngineInfo, ServeOptions
from trtprompt.serve.ports import http_ok

CORE_MODEL = "tensorrt_llm"
MAX_PORT = 65535


@dataclass(frozen=True)
class TrtllmLaunchSpec:
    repo: Path
    world_size: int = 1
    tritonserver: str = "tritonserver"
    mpirun: str = "mpirun"
    host: str = I.DEFAULT_HOST
    http_port: int = I.HTTP_PORT
    grpc_port: int = I.GRPC_PORT
    metrics_port: int = I.METRICS_PORT
    log_verbose: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            if not 1 <= port <= MAX_PORT:
                raise ValueError(f"{name} must be in [1, {MAX_PORT}], got {port}")
        if len({self.http_port, self.grpc_port, self.metrics_port}) != 3:
            raise ValueError("http_port, grpc_port and metrics_port must differ")
        if self.log_verbose < 0:
            raise ValueError(f"log_verbose must be >= 0, got {self.log_verbose}")


def rank_args(spec: TrtllmLaunchSpec, rank: int) -> list[str]:
    """tritonserver and its arguments for one rank."""
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank must be in [0, {spec.world_size - 1}], got {rank}")
    args = [spec.tritonserver, f"--model-repository={spec.repo}"]
    if rank > 0:
        # Workers host only the engine shard; rank 0 owns the endpoints and the other models.
        args += ["--model-control-mode=explicit", f"--load-model={CORE_MODEL}"]
    args += [
        f"--http-address={spec.host}", f"--http-port={spec.http_port}",
        f"--grpc-address={spec.host}", f"--grpc-port={spec.grpc_port}",
        f"--metrics-address={spec.host}", f"--metrics-port={spec.metrics_port}",
        "--allow-metrics=true",
        "--disable-auto-complete-config",
        f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
    ]
    if spec.log_verbose:
        args.append(f"--log-verbose={spec.log_verbose}")
    return args


def launch_command(spec: TrtllmLaunchSpec) -> list[str]:
    if spec.world_size == 1:
        return rank_args(spec, 0)
    cmd = [spec.mpirun, "--allow-run-as-root"]
    for rank in range(spec.world_size):
        if rank:
            cmd.append(":")
        cmd += ["-n", "1", *rank_args(spec, rank)]
    return cmd


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher's process group (mpirun forwards it to the ranks), SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def wait_ready(proc: subprocess.Popen[bytes], spec: TrtllmLaunchSpec, timeout_s: float, log_file: Path) -> None:
    url = f"http://{'127.0.0.1' if spec.host in ('0.0.0.0', '::') else spec.host}:{spec.http_port}/v2/health/ready"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LaunchError(f"tritonserver exited with code {proc.returncode} before it was ready; "
                              f"last log lines:\n{log_tail(log_file)}")
        if http_ok(url):
            return
        time.sleep(0.5)
    raise LaunchError(f"tritonserver was not ready within {timeout_s:.0f} s (engine load can take minutes: "
                      f"raise --ready-timeout); last log lines:\n{log_tail(log_file)}")


def run_tritonserver(spec: TrtllmLaunchSpec, log_file: Path, ready_timeout_s: float, what: str,
                     echo: Callable[[str], None]) -> int:
    """Start tritonserver on spec, say it is ready (serving `what`), and watch it until SIGINT/SIGTERM.

    The trtllm and llmapi targets share it: their tritonserver runs TensorRT-LLM's own models, so
    nothing of trtprompt's runs beside it (the torch target's launcher.py starts more processes).
    """
    stop = threading.Event()
    with stop_on_signals(stop.set):
        with log_file.open("ab") as log:
            proc = subprocess.Popen(launch_command(spec), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            wait_ready(proc, spec, ready_timeout_s, log_file)
            echo(f"trtprompt serve: ready ({what})\n  gRPC {spec.host}:{spec.grpc_port}  HTTP {spec.host}:"
                 f"{spec.http_port}  metrics http://{spec.host}:{spec.metrics_port}/metrics\n  logs {log_file}")
            return watch_children(stop, lambda: [(proc, "tritonserver", log_file)], 1.0,
                                  lambda note: echo(f"trtprompt serve: {note}"))
        except LaunchError as exc:
            echo(f"trtprompt serve: {exc}")
            return 1
        finally:
            _stop(proc)


def serve_trtllm(engine: EngineInfo, options: ServeOptions, ports: Ports, run_dir: Path | None = None,
                 ready_timeout_s: float = 600.0, echo: Callable[[str], None] = print) -> int:
    """Check, write the repository, start tritonserver (under mpirun for tp x pp > 1), wait for SIGINT/SIGTERM."""
    from trtprompt.serve.launch.repository import RepoContext, write_repository
    from trtprompt.targets.trtllm_checks import preflight

    pf = preflight(engine.path, asdict(options))
    run = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="trtprompt-trtllm-"))
    repo = write_repository(run / "repository", RepoContext(engine, options, ""))
    spec = TrtllmLaunchSpec(repo, pf.world_size, str(pf.tritonserver), host=ports.host, http_port=ports.http,
                            grpc_port=ports.grpc, metrics_port=ports.metrics)
    return run_tritonserver(spec, run / "tritonserver.log", ready_timeout_s,
                            f"TensorRT-LLM engine {engine.path.name}, {pf.world_size} rank(s)", echo)

"""Starting a `trtprompt serve` for a scenario and waiting until it says it is ready."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from trtprompt.bench.machine import ROOT

READY_LINE = "trtprompt serve: ready"


def serve_argv(engine_dir: Path, run_dir: Path, ports: Sequence[int], *extra: str) -> list[str]:
    """The serve command line with the gRPC, HTTP and metrics ports (ports[:3]) and extra options."""
    grpc, http, metrics = ports[:3]
    return [sys.executable, "-m", "trtprompt.cli", "serve", str(engine_dir), "--run-dir", str(run_dir),
            "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics), *extra]


def wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout_s: float, poll_s: float = 0.2) -> None:
    """Polls the log for the ready line; a server that exits or runs past the deadline is killed."""
    deadline = time.monotonic() + timeout_s
    while READY_LINE not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"serve did not become ready:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(poll_s)


def start_serve(argv: Sequence[str], log: Path, timeout_s: float, *, cwd: Path = ROOT,
                env: Mapping[str, str] | None = None, new_session: bool = False,
                poll_s: float = 0.2) -> subprocess.Popen[bytes]:
    """Runs argv with its output in log and returns once it is ready.

    new_session: its own session, so every process group of its tree is the server's, never ours."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(list(argv), stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                                env=None if env is None else dict(env), start_new_session=new_session)
    wait_ready(proc, log, timeout_s, poll_s)
    return proc

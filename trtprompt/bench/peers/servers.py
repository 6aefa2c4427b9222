"""Processes of the side-by-side: commands run to completion, and servers started, waited for and always stopped
(the whole process group: a peer's server leaves no child behind)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

ROOT = Path(__file__).resolve().parents[3]


def log(msg: str) -> None:
    print(f"[bench-peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def show(cmd: Sequence[Any]) -> str:
    return " ".join(str(c) for c in cmd)


def run_checked(cmd: Sequence[Any], **kwargs: Any) -> None:
    log("$ " + show(cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(url: str) -> bytes | None:
    """The body of a 200 answer, else None."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body: bytes = resp.read()
            return body if resp.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before {url} was ready")
        if http_get(url) is not None:
            return
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """SIGTERM the server (each shuts its children down on it), then SIGKILL its process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the session started for it
    except ProcessLookupError:
        pass
    proc.wait()


@contextmanager
def server(cmd: Sequence[Any], env: dict[str, str], ready_url: str, log_path: Path,
           timeout_s: float) -> Iterator[subprocess.Popen[bytes]]:
    """A server in a session of its own, its output in log_path; stopped on the way out, whatever happened."""
    log(f"starting server, log in {log_path}: {show(cmd)}")
    with open(log_path, "w", encoding="utf-8") as out:
        proc = subprocess.Popen([str(c) for c in cmd], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_ready(ready_url, proc, timeout_s)
        log(f"server ready ({ready_url})")
        yield proc
    finally:
        stop_server(proc)
        log("server stopped")

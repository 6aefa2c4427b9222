"""The one watch loop (launcher.watch_children) and signal scope (stop_on_signals) that the torch
launcher and the trtllm launch share, with real child processes and real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from trtprompt.serve.launch.launcher import Ports, Server, spawn_child, stop_on_signals, watch_children
from trtprompt.serve.launch.options import EngineInfo, resolve_options


def test_a_child_that_exits_ends_the_watch_with_its_log(tmp_path: Path) -> None:
    log_path = tmp_path / "child.log"
    log_path.write_text("last words\n", encoding="utf-8")
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    notes: list[str] = []
    code = watch_children(threading.Event(), lambda: [(None, "not started", log_path), (child, "the child", log_path)],
                          0.01, notes.append)
    assert code == 1 and child.returncode == 3
    assert notes == ["the child exited with code 3:\nlast words"]


def test_stop_ends_the_watch_and_tick_may_end_it_with_its_code(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    assert watch_children(stop, lambda: [], 0.01, print) == 0
    ticks: list[int] = []

    def tick() -> int | None:
        ticks.append(1)
        return 7 if len(ticks) == 3 else None

    assert watch_children(threading.Event(), lambda: [], 0.01, print, tick) == 7 and len(ticks) == 3


def test_a_dead_tritonserver_ends_the_watch_under_no_restart(tiny_engine_dir: Path, tmp_path: Path) -> None:
    """Without --no-restart the launcher starts tritonserver again (tests/test_serve_faults.py)."""
    engine = EngineInfo.read(tiny_engine_dir, None)
    notes: list[str] = []
    server = Server(engine, resolve_options(engine, {}), Ports(), tmp_path / "run", restart_engine=False,
                    log=notes.append)
    server.triton_log.write_text("its last words\n", encoding="utf-8")
    server.triton_proc = spawn_child([sys.executable, "-c", "raise SystemExit(6)"], server.triton_log, {})
    server.triton_proc.wait()
    assert server.watch() == 1
    assert notes == ["tritonserver exited with code 6; gRPC and HTTP are down meanwhile:\nits last words",
                     "--no-restart: stopping the server"]
    assert server.triton_restarts == 0


def test_signals_call_stop_inside_the_scope_only() -> None:
    before = signal.getsignal(signal.SIGTERM)
    stop = threading.Event()
    with stop_on_signals(stop.set):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this (the main) thread
        assert stop.wait(60)
    assert signal.getsignal(signal.SIGTERM) is before

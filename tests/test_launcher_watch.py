"""The one watch loop (launcher.watch_children) and signal scope (stop_on_signals) that the torch
launcher and the trtllm launch share, with real child processes and real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from trtprompt.serve.launch.launcher import stop_on_signals, watch_children


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


def test_signals_call_stop_inside_the_scope_only() -> None:
    before = signal.getsignal(signal.SIGTERM)
    stop = threading.Event()
    with stop_on_signals(stop.set):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this (the main) thread
        assert stop.wait(60)
    assert signal.getsignal(signal.SIGTERM) is before

"""`trtprompt serve` stopped by SIGINT (Ctrl-C) and by SIGTERM: no process crashes, nothing is left.

Every stop used to end the tensorrt_llm stub with a SIGSEGV at address 0x60 (4 of 4 stops, SIGINT
and SIGTERM): its pb_utils metric families outlived finalize() and their destructors ran inside the
stub's own teardown, through a null shared-memory pool (core dump backtrace: Metric::SaveToSharedMemory
<- Metric::Clear <- MetricFamily::~MetricFamily <- Stub::~Stub; serve/triton_models/metrics_publisher.py).
tritonserver reaps its stubs without logging how they ended, so the stubs run with faulthandler
enabled (stub.py): a crash leaves "Fatal Python error: Segmentation fault" in tritonserver.log, which
this test reads (with faulthandler the kernel no longer logs it, the signal being handled); where the
kernel log is readable it is checked too.
"""

from __future__ import annotations

import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
from serve_fixtures import Served, _alive, start_server, stop_server

from trtprompt.serve.launch.process_group import SHM_DIR, descendants

pytestmark = pytest.mark.server

CRASH_MARKS = ("Segmentation fault", "signal 11", "Fatal Python error", "core dumped", "SIGSEGV")
STOP_TIMEOUT_S = 60.0


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _kernel_segfaults() -> list[str] | None:
    """The kernel log's segfault lines, or None where it cannot be read (no dmesg, no permission)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [line for line in out.stdout.splitlines() if "segfault" in line]


def _logs(served: Served) -> dict[str, str]:
    paths = [served.log_path, *sorted(served.run_dir.glob("*.log"))]
    return {str(p): p.read_text(errors="replace") for p in paths if p.is_file()}


def _stop(served: Served, sig: signal.Signals) -> int | None:
    served.proc.send_signal(sig)
    try:
        return served.proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        served.proc.wait()
        return None


SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(scope="module")
def servers(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Served]]:
    """One server per signal, started side by side; each test stops its own."""
    root = tmp_path_factory.mktemp("clean-stop")
    with ThreadPoolExecutor(len(SIGNALS)) as pool:
        starts = {sig.name: pool.submit(start_server, tiny_engine_dir, root / sig.name) for sig in SIGNALS}
    started = {name: f.result() for name, f in starts.items() if f.exception() is None}
    try:
        for f in starts.values():
            f.result()  # a failed start fails every test here
        yield started
    finally:
        for served in started.values():  # one its test did not get to stop
            stop_server(served)


@pytest.mark.parametrize("sig", SIGNALS, ids=[sig.name for sig in SIGNALS])
def test_stop_crashes_nothing_and_leaves_nothing(servers: dict[str, Served], sig: signal.Signals) -> None:
    served = servers[sig.name]
    # Both models served a request and the publisher made its metrics: what finalize must undo.
    assert served.text("before the stop", 4).error is None
    assert served.tokens([5, 6, 7], 4).error is None
    assert served.metric("trtprompt_engine_info") is not None
    pids = descendants(served.proc.pid)
    stubs = [pid for pid in pids if _comm(pid).startswith("triton_python")]
    assert len(stubs) == 2, f"expected the two models' stubs among {pids}"
    kernel_before = _kernel_segfaults()

    code = _stop(served, sig)

    logs = _logs(served)
    assert code == 0, f"serve exited with {code}:\n{logs[str(served.log_path)][-3000:]}"
    left = [pid for pid in pids if _alive(pid)]
    assert not left, f"processes left after {sig.name}: {left}"
    crashes = {path: mark for path, text in logs.items() for mark in CRASH_MARKS if mark in text}
    assert not crashes, f"a process crashed at {sig.name}: {crashes}\n" + "\n".join(
        text[-2000:] for path, text in logs.items() if path in crashes)
    # stop() notes everything it had to kill or unlink: a clean stop needs neither.
    assert "trtprompt serve: stop:" not in logs[str(served.log_path)]
    prefix = f"trtprompt_{served.proc.pid}_"
    assert not sorted(SHM_DIR.glob(f"{prefix}*")), "shared memory regions left behind"
    kernel_after = _kernel_segfaults()
    if kernel_before is not None and kernel_after is not None:
        new = [line for line in kernel_after if line not in kernel_before]
        ours = [line for line in new if any(f"[{pid}]" in line for pid in pids)]
        assert not ours, f"the kernel saw a segfault at {sig.name}: {ours}"

"""Stop a child's whole process group and clean what it leaves (issue 11).

Each child of `trtprompt serve` leads its own process group (start_new_session), and
tritonserver's python stubs are in tritonserver's group. A stub can outlive tritonserver
(it notices a dead parent only on its own schedule) and then holds its /dev/shm region;
so after a leader exits, what is left of its group is killed, and the regions named with
this server's prefix are unlinked. Everything that had to be killed or removed is returned
as a note for the operator.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

SHM_DIR = Path("/dev/shm")
# After a group's leader exits, how long the other members get to follow it by themselves.
GROUP_GRACE_S = 5.0


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def descendants(pid: int) -> list[int]:
    """Every process below pid in the process tree (read from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def describe(pids: Sequence[int]) -> str:
    names = []
    for pid in pids:
        try:
            names.append(f"{Path(f'/proc/{pid}/comm').read_text().strip()} (pid {pid})")
        except OSError:
            names.append(f"pid {pid}")
    return ", ".join(names)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_empty(pgid: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def stop_group(proc: subprocess.Popen[bytes] | None, name: str, timeout_s: float,
               grace_s: float = GROUP_GRACE_S) -> list[str]:
    """SIGTERM the group led by proc; SIGKILL it when the leader outlives timeout_s, or when any
    member outlives the leader by grace_s. Returns notes on what had to be killed."""
    if proc is None:
        return []
    notes = []
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            notes.append(f"{name} did not exit within {timeout_s:.0f}s of SIGTERM: killed with its group "
                         f"({describe(group_members(proc.pid))})")
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(5.0)
    left = _wait_empty(proc.pid, grace_s)
    if left:
        notes.append(f"{describe(left)} outlived {name} by {grace_s:.0f}s: killed")
        _signal_group(proc.pid, signal.SIGKILL)
        _wait_empty(proc.pid, 5.0)
    return notes


def remove_shm(prefix: str) -> list[str]:
    """Unlink the /dev/shm segments whose names start with prefix."""
    notes = []
    for seg in sorted(SHM_DIR.glob(f"{prefix}*")):
        try:
            seg.unlink()
            notes.append(f"removed leftover shared memory {seg}")
        except OSError as exc:
            notes.append(f"could not remove leftover shared memory {seg}: {exc}")
    return notes

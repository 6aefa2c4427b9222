"""stop_group / remove_shm (trtprompt.serve.launch.process_group): a child that outlives its group's
leader is killed and reported, as Triton's python stub outliving tritonserver was (issue 11)."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from trtprompt.serve.launch.process_group import SHM_DIR, group_members, remove_shm, stop_group

# A leader that exits on SIGTERM, with a child that ignores it (like a stub busy elsewhere).
LEADER = """
import signal, subprocess, sys, time
subprocess.Popen([sys.executable, "-c",
                  "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
                 stdout=sys.stdout)
time.sleep(600)
"""


def _spawn(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_a_member_outliving_the_leader_is_killed_and_reported():
    proc = _spawn(LEADER)
    assert len(group_members(proc.pid)) == 2
    notes = stop_group(proc, "the leader", timeout_s=10.0, grace_s=0.5)
    assert group_members(proc.pid) == []
    assert len(notes) == 1 and notes[0].endswith("outlived the leader by 0s: killed") and "python" in notes[0]


def test_a_leader_ignoring_sigterm_is_killed_with_its_group():
    proc = _spawn("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print('up', flush=True); time.sleep(600)")
    notes = stop_group(proc, "stubborn", timeout_s=0.5, grace_s=0.5)
    assert proc.returncode is not None and group_members(proc.pid) == []
    assert notes and notes[0].startswith("stubborn did not exit within 0s of SIGTERM: killed with its group")


def test_a_clean_stop_says_nothing():
    proc = _spawn("import time; print('up', flush=True); time.sleep(600)")
    assert stop_group(proc, "polite", timeout_s=10.0, grace_s=0.5) == []
    assert stop_group(None, "absent", 1.0) == []


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
def test_remove_shm_only_takes_its_prefix():
    prefix = f"trtprompt_test_{uuid.uuid4().hex}_"
    mine, other = SHM_DIR / f"{prefix}region", SHM_DIR / f"trtprompt_other_{uuid.uuid4().hex}"
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    try:
        assert remove_shm(prefix) == [f"removed leftover shared memory {mine}"]
        assert not mine.exists() and other.exists()
    finally:
        other.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)

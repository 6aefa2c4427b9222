"""The engine keeps freed activation memory mapped (engine/host_memory.py), unless the operator chose."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from trtprompt.engine import host_memory

# A step's pattern: several activations allocated, filled, then all freed. Counted are the
# page faults of 10 such rounds after 10 warm ones. "handback" pins glibc to handing every
# large chunk back on free (mmap threshold 128 KiB, fixed): each round's 8 x 4 MB fault in
# again (8 x 1,024 pages a round), which shows the probe sees the faults. glibc's default
# lies between the two: it trims the heap top whenever enough of it is free, which depends
# on what else was allocated meanwhile, so it is not a fixed baseline.
PROBE = """
import ctypes, json, resource, sys, torch
from trtprompt.engine.host_memory import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, keep_freed_memory
if sys.argv[1] == "keep":
    said = keep_freed_memory()
else:
    libc = ctypes.CDLL("libc.so.6")
    said = str(libc.mallopt(M_MMAP_THRESHOLD, 128 << 10) + libc.mallopt(M_TRIM_THRESHOLD, 128 << 10))
def step():
    xs = [torch.empty(1 << 20).fill_(1.0) for _ in range(8)]
for _ in range(10):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(json.dumps({"said": said, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def probe(mode: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings apply to glibc only")
def test_freed_tensor_pages_stay_mapped() -> None:
    handback, kept = probe("handback"), probe("keep")
    assert handback["said"] == "2"  # both mallopt calls took
    assert kept["said"].startswith("malloc keeps freed memory")
    assert handback["faults"] >= 10 * 8 * 1024 // 2, handback  # rounds fault their pages in again
    assert kept["faults"] < 1024, kept  # under one tensor's worth in all


def test_operator_choice_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in host_memory.OPERATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    assert host_memory.operator_choice() is None
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")  # not a malloc setting
    assert host_memory.operator_choice() is None
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert host_memory.operator_choice() == "LD_PRELOAD"
    assert host_memory.keep_freed_memory() == "malloc left as the operator set it (LD_PRELOAD)"
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert host_memory.operator_choice() == "MALLOC_TRIM_THRESHOLD_"

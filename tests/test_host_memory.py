"""The engine keeps freed activation memory mapped (engine/host_memory.py), unless the operator chose."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from trtprompt.engine import host_memory

# A step's pattern: several activations allocated, filled, then all freed. Counted are the
# page faults of 10 such rounds after 10 warm ones. glibc's default raises its mmap threshold
# to the largest freed chunk but trims the heap top once more than twice that is free, so
# each round's 8 x 4 MB fault in again (8 x 1,024 pages a round); kept, they stay mapped.
PROBE = """
import json, resource, sys, torch
from trtprompt.engine.host_memory import keep_freed_memory
said = keep_freed_memory() if sys.argv[1] == "keep" else "default"
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
    default, kept = probe("default"), probe("keep")
    assert kept["said"].startswith("malloc keeps freed memory")
    assert default["faults"] >= 10 * 8 * 1024 // 2, default  # rounds fault their pages in again
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

"""The one description of the machine a benchmark ran on: CPU model, family/model, ISA flags, cores, load, commit.

Every report prints it (BENCHMARKS.md states the CPU and its flags with every figure): ratios carry
between machines only with the instruction sets that produced them. Flags come from engine/isa.py's
reader (/proc/cpuinfo, else torch's dispatch), filtered to those that decide which kernels run.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from trtprompt.engine import isa

ROOT = Path(__file__).resolve().parents[2]
# Prefixes of the flags that choose kernels: vector width, bf16 / fp16 / int8 dot products, AMX tiles.
KERNEL_FLAG_PREFIXES = ("avx2", "avx512", "amx", "avx_vnni", "fma", "f16c")


def _cpuinfo_field(name: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    try:
        for line in cpuinfo.read_text(encoding="utf-8").splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def kernel_flags(flags: frozenset[str] | None = None) -> list[str]:
    """The CPU's flags that decide which kernels run, sorted."""
    have = isa.cpu_flags() if flags is None else flags
    return sorted(f for f in have if f.startswith(KERNEL_FLAG_PREFIXES))


def describe() -> dict[str, Any]:
    """CPU model name, family and model numbers, kernel flags, cores, load, commit and UTC time."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip()
    return {"cpu": _cpuinfo_field("model name") or "unknown", "cpu_family": _cpuinfo_field("cpu family"),
            "cpu_model": _cpuinfo_field("model"), "flags": kernel_flags(), "cores": os.cpu_count(),
            "loadavg_start": list(os.getloadavg()), "trtprompt_commit": commit or None,
            "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def one_line(info: dict[str, Any] | None = None) -> str:
    """`<cores>-core <cpu> (family F model M; flags)`, the form BENCHMARKS.md states machines in."""
    d = describe() if info is None else info
    return (f"{d['cores']}-core {d['cpu']} (family {d['cpu_family']} model {d['cpu_model']}; "
            f"{' '.join(d['flags']) or 'no AVX2/AVX-512/AMX flags'})")


def print_and_write(result: dict[str, Any], out: Path | None) -> None:
    """A scenario's result with the machine under "machine", printed as JSON and written to `out` when given."""
    text = json.dumps({**result, "machine": describe()}, indent=1, default=str)
    print(text)
    if out is not None:
        out.write_text(text, encoding="utf-8")

"""How fast the host is right now: the vector FMA units' rate and the memory's read rate, probed in well under a
second, so a report can say what state a shared host was in when each round ran.

A shared host's speed moves by up to 1.6x within minutes (other tenants; BENCHMARKS.md, machine B), by more than
most of the differences a side-by-side measures. The side-by-side probes before every round
(bench/peers/sidebyside.py) and prints the probes beside the ratios.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

# Rounds of the FMA probe (12 chains of vector FMAs each, csrc/host_probe.cpp): ~0.1 s at 150 GFLOP/s on two cores.
FMA_ITERATIONS = 20_000_000 // 12
# Bytes read by the memory probe: far past the caches of the CPUs seen (L3 up to 32 MiB a socket here).
READ_BYTES = 256 << 20


def read_bandwidth_gbs(nbytes: int = READ_BYTES, reps: int = 5) -> float:
    """Memory read bandwidth: a sum over a buffer far larger than the caches (median of reps)."""
    import torch

    x = torch.ones(nbytes // 4)
    x.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


def fma_gflops(iterations: int = FMA_ITERATIONS) -> float | None:
    """The FMA units' rate over all torch threads (GFLOP/s), or None without the compiled kernels."""
    import torch

    from trtprompt.engine import kernels

    if not kernels.compiled_kernel_status()[0]:
        return None
    return float(torch.ops.trtprompt.fma_rate(iterations))


def probe() -> dict[str, Any]:
    """{"fma_gflops", "read_gbs", "time_utc"} of this moment."""
    return {"fma_gflops": fma_gflops(), "read_gbs": read_bandwidth_gbs(),
            "time_utc": time.strftime("%H:%M:%S", time.gmtime())}


def one_line(p: dict[str, Any]) -> str:
    """`FMA 145 GFLOP/s, read 23.1 GB/s at 10:13:37` (FMA n/a without the compiled kernels)."""
    fma = "n/a" if p.get("fma_gflops") is None else f"{p['fma_gflops']:.0f}"
    return f"FMA {fma} GFLOP/s, read {p['read_gbs']:.1f} GB/s at {p['time_utc']}"

"""How the server of a `--compare start=cold,warm,restart` variant starts, level by level.

- cold: a fresh server, as for every other variant: the measured requests meet an empty pool.
- warm: a fresh server first serves every request of the level once (unmeasured), then the measured
  run sends the same requests: their prefixes are in the pool.
- restart: a server with a disk KV tier (a new directory under the output directory) serves every
  request of the level once and is stopped, which drains the tier's writer (the engine process closes
  its tiers on the way out); a NEW server over the same directory runs the measured requests, its pool
  empty, its prefixes read from the disk tier (docs/prefix-pool.md). The directory is removed after.

On a workload whose prompts share no prefix among themselves (random; shared-prefix with
--num-prefixes at least the requests), restart over warm and over cold TTFT are issue 24's restart
targets, and the report's per-tier rows say where the reused blocks came from (docs/bench/README.md).
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from trtprompt.bench.runner import LoadSpec, RunResult
from trtprompt.bench.workloads import Workload

STARTS = ("cold", "warm", "restart")
Serve = Callable[[Mapping[str, Any]], AbstractContextManager[tuple[str, str]]]  # overrides -> (url, metrics url)
Prime = Callable[[str, Workload, LoadSpec], int]  # url, workload, load -> failed requests
Measure = Callable[[str, str, Workload, LoadSpec], RunResult]  # url, metrics url, workload, load


def check_start(value: str) -> str:
    if value not in STARTS:
        raise ValueError(f"start must be one of {', '.join(STARTS)}, got {value!r}")
    return value


def _primed(prime: Prime, url: str, workload: Workload, load: LoadSpec, echo: Callable[[str], None]) -> None:
    failed = prime(url, workload, load)
    if failed:  # the measured run still runs: its hit figures show what the priming left
        echo(f"bench: {failed} of {len(workload.requests)} priming requests failed")


def run_started(start: str, loads: Sequence[LoadSpec], workloads: Sequence[Workload],
                overrides: Mapping[str, Any], serve: Serve, prime: Prime, measure: Measure, work_dir: Path,
                echo: Callable[[str], None]) -> dict[str, RunResult]:
    """Each level's measured run after a warm or restart start (cold runs as any variant does)."""
    check_start(start)
    out = {}
    for load, workload in zip(loads, workloads):
        if start == "warm":
            with serve(overrides) as (url, metrics_url):
                _primed(prime, url, workload, load, echo)
                out[load.label] = measure(url, metrics_url, workload, load)
            continue
        work_dir.mkdir(parents=True, exist_ok=True)
        disk = Path(tempfile.mkdtemp(prefix="restart-disk-tier-", dir=work_dir))
        tiered = {**overrides, "disk_cache_path": str(disk)}
        try:
            with serve(tiered) as (url, _metrics_url):
                _primed(prime, url, workload, load, echo)
            echo(f"bench: restarting the server over its disk tier ({load.label})")
            with serve(tiered) as (url, metrics_url):
                out[load.label] = measure(url, metrics_url, workload, load)
        finally:
            shutil.rmtree(disk, ignore_errors=True)
    return out

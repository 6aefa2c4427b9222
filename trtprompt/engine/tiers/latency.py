"""Each tier read's latency, kept until the metrics take it (a Prometheus histogram per tier).

The loader's reader threads observe one value per block a tier returned: the time from asking the
tier to a verified payload (store get plus the codec's checks). The engine process drains them into
its counters between polls of /metrics (serve/engine_process/counters.py); the family is
`trtprompt_kv_tier_load_seconds{tier}` (serve/metrics_catalog.py, docs/prefix-pool.md "Metrics").
Bounded: when nobody drains (an engine without a server), the oldest observations are dropped.
"""

from __future__ import annotations

import threading
from collections import deque

# Observations kept between drains; a poll every second sees far fewer block reads than this.
LATENCIES_KEPT = 8192


class LoadLatencies:
    """(tier name, seconds) of recent block reads; thread-safe."""

    def __init__(self, kept: int = LATENCIES_KEPT) -> None:
        if kept < 1:
            raise ValueError(f"kept must be >= 1, got {kept}")
        self._lock = threading.Lock()
        self._seen: deque[tuple[str, float]] = deque(maxlen=kept)
        self.observed = 0  # every observation since start, drained or not (tests, statistics)

    def observe(self, tier: str, seconds: float) -> None:
        with self._lock:
            self._seen.append((tier, seconds))
            self.observed += 1

    def drain(self) -> list[tuple[str, float]]:
        """Every observation not drained yet, oldest first."""
        with self._lock:
            out = list(self._seen)
            self._seen.clear()
        return out

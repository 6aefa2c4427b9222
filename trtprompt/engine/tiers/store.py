"""What a tier below the engine's KV pool is: a byte store keyed by block keys.

A store knows nothing of KV tensors, fingerprints or checksums: the codec
above it (tiers/codec.py) frames each block's bytes with its key, the
engine fingerprint and a checksum, and treats anything it cannot verify as a
miss. A store therefore only moves bytes, and turns every fault of its own
(disk full, Redis down or slow, a half-written file) into a miss or a dropped
write, counted in its `TierCounters`, never into an exception on the
engine's step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Protocol


@dataclass
class TierCounters:
    """What one tier did since it opened; read by the engine's statistics and the metrics.

    Updated from several threads at once (the tier's writer, the loader's readers, the engine's
    step), so every update goes through add(), under the counters' own lock: a bare `+=` from two
    threads can lose a count."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    drops: int = 0  # writes not done: queue full, store full, store down or slow
    evictions: int = 0  # entries the store removed to make room
    errors: int = 0  # faults seen (I/O errors, timeouts, corrupt entries), each also a miss or a drop
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Add each count to its field (add(hits=1, bytes_read=n)), atomically."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        """Every count, read at one instant."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class BlockStore(Protocol):
    """A tier's storage. Every method may be called from the tier's writer thread or the engine's loader."""

    name: str  # "disk" or "redis": the tier label in metrics and statistics
    counters: TierCounters

    def get(self, key: bytes) -> bytes | None:
        """The bytes stored under key; None on a miss or on any fault (counted)."""
        ...

    def put(self, key: bytes, value: bytes) -> bool:
        """Store value under key, replacing any; False when the write was dropped (counted)."""
        ...

    def delete(self, key: bytes) -> None:
        """Remove key if present (a corrupt or foreign entry being reclaimed)."""
        ...

    def probe(self) -> str | None:
        """None when the store is usable as configured; else what to fix (logged once, at start). Never raises."""
        ...

    def close(self) -> None:
        """Release files and connections; later calls may be refused."""
        ...

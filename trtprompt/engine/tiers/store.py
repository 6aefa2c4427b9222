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

from dataclasses import dataclass
from typing import Protocol


@dataclass
class TierCounters:
    """What one tier did since it opened; read by the engine's statistics and the metrics."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    drops: int = 0  # writes not done: queue full, store full, store down or slow
    evictions: int = 0  # entries the store removed to make room
    errors: int = 0  # faults seen (I/O errors, timeouts, corrupt entries), each also a miss or a drop


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

    def close(self) -> None:
        """Release files and connections; later calls may be refused."""
        ...

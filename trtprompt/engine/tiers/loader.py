"""The tier loader: one thread that reads and verifies a waiting request's blocks, tier by tier.

A job is one request's next block keys, in prefix order. For each key the loader asks the tiers
in order (disk, then remote) and checks what comes back with the codec; it stops at the first
key no tier has, since a block past a gap cannot be used. A corrupt, truncated, foreign or
half-written entry is a miss, and is deleted from its store (reclaimed). The engine thread
collects finished jobs between steps (`done`), so a load never holds up another request's step.

The keys of one job are read by a small pool of threads (file reads, socket reads and crc32 all
release the GIL), so reading a long prefix uses the cores the engine leaves idle while it waits;
the results are still taken in prefix order, and reads past the first miss are cancelled.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from trtprompt.engine.tiers.codec import CodecError, Payload, decode
from trtprompt.engine.tiers.latency import LoadLatencies
from trtprompt.engine.tiers.store import BlockStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadJob:
    request_id: str
    keys: tuple[bytes, ...]


@dataclass
class LoadResult:
    request_id: str
    blocks: list[tuple[str, Payload]] = field(default_factory=list)  # (tier name, payload bytes), in order
    seconds: float = 0.0


READ_THREADS = max(1, min(4, os.cpu_count() or 1))


class TierLoader:
    def __init__(self, stores: list[BlockStore], block_bytes: int, read_threads: int = READ_THREADS) -> None:
        self.stores = stores
        self.block_bytes = block_bytes
        self.corrupt = dict.fromkeys((s.name for s in stores), 0)  # entries that failed the codec, reclaimed
        self._corrupt_lock = threading.Lock()  # corrupt: the reader threads update it (counters have their own)
        self.latencies = LoadLatencies()  # each verified block read, per tier (the metrics' histogram)
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="trtprompt-tier-read")
        self._jobs: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        self.ready = threading.Event()  # set when a result is waiting
        self._thread = threading.Thread(target=self._run, name="trtprompt-tier-loader", daemon=True)
        self._thread.start()

    def submit(self, job: LoadJob) -> None:
        self._jobs.put(job)

    def done(self) -> list[LoadResult]:
        """Finished jobs, without waiting."""
        self.ready.clear()
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            t0 = time.perf_counter()
            result = LoadResult(job.request_id)
            reads: list[Future[tuple[str, Payload] | None]] = [self._readers.submit(self._read, k) for k in job.keys]
            try:
                for read in reads:
                    found = read.result()
                    if found is None:
                        break
                    result.blocks.append(found)
            except Exception:  # noqa: BLE001 - a store bug is a miss, and the request must come back
                log.exception("tier load failed; the request computes its prefix instead")
            for read in reads:
                read.cancel()  # past the first miss: not needed (those already running finish)
            result.seconds = time.perf_counter() - t0
            self._done.put(result)
            self.ready.set()

    def _read(self, key: bytes) -> tuple[str, Payload] | None:
        for store in self.stores:
            t0 = time.perf_counter()
            data = store.get(key)
            if data is None:
                continue
            try:
                payload = decode(key, data, self.block_bytes)
            except CodecError as exc:
                with self._corrupt_lock:
                    self.corrupt[store.name] += 1
                store.counters.add(errors=1)  # under the counters' lock: the store's own threads add too
                log.warning("tier %s: entry %s is unusable (%s); reclaimed", store.name, key.hex(), exc)
                store.delete(key)
                continue
            self.latencies.observe(store.name, time.perf_counter() - t0)
            return store.name, np.frombuffer(payload, dtype=np.uint8)
        return None

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5.0)
        self._readers.shutdown(wait=False, cancel_futures=True)

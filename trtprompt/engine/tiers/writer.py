"""The background writer of one tier: a bounded queue and a thread, so a store never stalls a step.

The engine step only copies a block's KV out of the pool (tiered.py) and offers it here; when the
queue is full the block is dropped and counted (`queue_drops`): a slow or full tier loses writes,
never time. One writer per tier, so a slow remote tier does not hold back the disk tier's writes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from trtprompt.engine.tiers.codec import Payload, encode
from trtprompt.engine.tiers.store import BlockStore

log = logging.getLogger(__name__)

# How many blocks a tier's queue holds (each a copy of one block's KV) before writes are dropped.
DEFAULT_QUEUE_BLOCKS = 256


class TierWriter:
    def __init__(self, store: BlockStore, queue_blocks: int = DEFAULT_QUEUE_BLOCKS) -> None:
        if queue_blocks < 1:
            raise ValueError(f"queue_blocks must be >= 1, got {queue_blocks}")
        self.store = store
        self.offered = 0  # blocks offered, and of those
        self.queue_drops = 0  # dropped for a full queue (both counted on the engine thread only)
        self._queue: queue.Queue[tuple[bytes, Payload] | None] = queue.Queue(maxsize=queue_blocks)
        self._thread = threading.Thread(target=self._run, name=f"trtprompt-tier-writer-{store.name}", daemon=True)
        self._thread.start()

    def offer(self, key: bytes, payload: Payload) -> bool:
        """Queue one block (payload: its KV bytes, a private copy); False, counted, when the queue is full."""
        return self.offer_waiting(key, payload, 0.0)

    def offer_waiting(self, key: bytes, payload: Payload, timeout_s: float) -> bool:
        """Queue one block, waiting up to timeout_s for room (write-back at close, off any step)."""
        self.offered += 1
        try:
            if timeout_s > 0:
                self._queue.put((key, payload), timeout=timeout_s)
            else:
                self._queue.put_nowait((key, payload))
        except queue.Full:
            self.queue_drops += 1
            return False
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, payload = item
                self.store.put(key, encode(key, payload.data))
            except Exception:  # noqa: BLE001 - a store bug must not end the writer
                self.store.counters.add(errors=1, drops=1)
                log.exception("tier %s: a write failed", self.store.name)
            finally:
                self._queue.task_done()

    def join(self) -> None:
        """Wait until every queued block was written or dropped (tests, shutdown)."""
        self._queue.join()

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop; after timeout_s in all, the blocks still queued are lost."""
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=max(timeout_s, 0.01))
        except queue.Full:
            log.warning("tier %s: writer still busy at shutdown; queued blocks are lost", self.store.name)
            return
        self._thread.join(max(deadline - time.monotonic(), 0.01))
        if self._thread.is_alive():
            log.warning("tier %s: writer still busy at shutdown; queued blocks are lost", self.store.name)

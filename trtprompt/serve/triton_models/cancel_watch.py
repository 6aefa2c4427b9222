"""One thread per stub that checks every request in flight for client cancellation.

Runs inside Triton's Python stub; stdlib only, so it is tested outside it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Protocol

log = logging.getLogger("trtprompt.relay")
# The watcher sweeps at least this often even when no step frame came.
IDLE_SWEEP_S = 0.5


class Watched(Protocol):
    def is_cancelled(self) -> bool: ...

    def cancel(self) -> None: ...


class Paced(Protocol):
    """What paces a watcher: the stub's EngineClient."""

    def steps(self) -> int: ...

    def behind(self) -> bool: ...


def watch_client(period_s: float, client: Paced) -> CancelWatcher:
    """The stub's one watcher, paced on its engine connection's step frames, read or waiting."""
    return CancelWatcher(period_s, client.steps, behind=client.behind)


class CancelWatcher:
    """One thread that checks every request in flight for cancellation, once per engine step.

    Replaces a polling loop per request. A check is an IPC round trip to
    tritonserver (both processes pay for it), and the engine can act on an
    abort only between steps, so checking a request more than once per step
    buys nothing: a sweep runs when `period_s` has passed AND the engine has
    stepped since the last sweep, or when `idle_s` has passed without a step
    (requests still queued, a long prefill). Under load that is one check per
    request per step instead of one per period; the thread sleeps while
    nothing is in flight.

    The engine has stepped when `steps()` (step frames the reader has read)
    moved, or when `behind()` (step frames wait unread): a reader busy
    relaying a backlog reads no frame for as long as that takes, and pacing
    on `steps()` alone then held every cancellation for up to `idle_s`
    (docs/design.md, "Cancellation").
    """

    def __init__(self, period_s: float, steps: Callable[[], int], idle_s: float = IDLE_SWEEP_S,
                 behind: Callable[[], bool] = lambda: False) -> None:
        self.period_s, self.idle_s = period_s, max(period_s, idle_s)
        self._steps, self._behind = steps, behind
        self._lock = threading.Lock()
        self._items: set[Watched] = set()
        self._busy = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trtprompt-cancel-watch", daemon=True)
        self._thread.start()

    def add(self, item: Watched) -> None:
        with self._lock:
            self._items.add(item)
        self._busy.set()

    def discard(self, item: Watched) -> None:
        with self._lock:
            self._items.discard(item)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Called from finalize(): once it returns, no is_cancelled() call may run (the stub's
        teardown follows, and a pb_utils call then dereferences a freed stub)."""
        self._stop.set()
        self._busy.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        seen, last = self._steps(), time.monotonic()
        while not self._stop.is_set():
            self._busy.wait()
            if self._stop.wait(self.period_s):
                return
            now, steps = time.monotonic(), self._steps()
            if steps == seen and now - last < self.idle_s and not self._behind():
                continue
            seen, last = steps, now
            with self._lock:
                items = list(self._items)
                if not items:
                    self._busy.clear()
            for item in items:
                if self._stop.is_set():  # a sweep of many IPC checks must not hold up finalize()
                    return
                self._check(item)

    def _check(self, item: Watched) -> None:
        try:
            if item.is_cancelled():
                item.cancel()
        except Exception:  # noqa: BLE001 - the watcher serves every request
            log.exception("cancellation check failed")

"""The stub's side of the engine protocol: one multiplexed connection, one reader.

A Python-backend stub (one per model instance) holds ONE `EngineClient`: a
connection to the engine process that every request of the stub shares.
Submits and aborts go out on it; one reader thread takes the engine's
per-step frames and calls each entry's handler. A lost connection ends every
request in flight with an UNAVAILABLE error entry, and the next submit
reconnects (the launcher restarts a dead engine process). One
`CancelWatcher` thread polls the client's cancellation for all requests in
flight. docs/design.md, "Request path and engine process protocol".

Stdlib only (no Triton), so it runs and is tested outside the stub.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Protocol

from trtprompt.error_codes import ErrorCode
from trtprompt.serve import protocol as P

log = logging.getLogger("trtprompt.relay")

# Called on the reader thread with each output entry of its request; the
# entry with "finished" true is the last call. Must not block for long:
# every other request of the stub waits behind it.
Handler = Callable[[dict[str, Any]], None]
# CancelWatcher sweeps at least this often even when no step frame came.
IDLE_SWEEP_S = 0.5


class _Session:
    """One connection and the requests submitted on it."""

    def __init__(self, path: str, on_step: Callable[[], None]) -> None:
        self.sock = P.connect(path)
        self._on_step = on_step
        self._lock = threading.Lock()  # guards _handlers and dead
        self._send_lock = threading.Lock()
        self._handlers: dict[str, Handler] = {}
        self.dead = False
        self._reader = threading.Thread(target=self._read, name="trtprompt-engine-reader", daemon=True)
        self._reader.start()

    def register(self, rid: str, handler: Handler) -> None:
        with self._lock:
            if self.dead:
                raise P.EngineUnavailableError(f"engine process unavailable: {P.LOST_MESSAGE}")
            self._handlers[rid] = handler

    def unregister(self, rid: str) -> bool:
        """True if rid was still waiting (so nobody has told it anything)."""
        with self._lock:
            return self._handlers.pop(rid, None) is not None

    def send(self, data: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(data)

    def kill(self, message: str) -> None:
        """End every request waiting on this connection with an UNAVAILABLE entry."""
        with self._lock:
            self.dead = True
            handlers, self._handlers = self._handlers, {}
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for rid, handler in handlers.items():
            _call(handler, {"id": rid, "finished": True, "error": message, "code": ErrorCode.UNAVAILABLE})

    def _read(self) -> None:
        reader = P.FrameReader()
        try:
            while not reader.closed:
                for frame in reader.feed(self.sock):
                    if frame.get("type") == "step":
                        self._on_step()
                        self._dispatch(frame["outputs"])
        except (OSError, ValueError) as exc:
            log.warning("engine connection lost: %s", exc)
        self.kill(P.LOST_MESSAGE)
        self.sock.close()

    def _dispatch(self, entries: Iterable[dict[str, Any]]) -> None:
        for entry in entries:
            with self._lock:
                rid = entry["id"]
                handler = self._handlers.pop(rid, None) if entry.get("finished") else self._handlers.get(rid)
            if handler is not None:
                _call(handler, entry)


def _call(handler: Handler, entry: dict[str, Any]) -> None:
    try:
        handler(entry)
    except Exception:  # noqa: BLE001 - a failing handler must not stop the reader
        log.exception("output handler failed for request %s", entry.get("id"))


class EngineClient:
    """The stub's one connection to the engine process (reconnects on demand)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._ids = itertools.count(1)
        self._steps = 0

    def _live_session(self) -> _Session:
        with self._lock:
            if self._session is None or self._session.dead:
                self._session = _Session(self.path, self._count_step)  # raises EngineUnavailableError
            return self._session

    def submit(self, prompt_token_ids: list[int], params: Mapping[str, Any], cache_salt: str | None,
               perf: bool, handler: Handler) -> str:
        """Send one request; returns its id. Raises EngineError / EngineUnavailableError.

        After a successful return, handler gets every output entry of the
        request, the last one finished (an error entry included); after a
        raise, it gets nothing.
        """
        rid = str(next(self._ids))
        frame = P.encode_frame({"op": "submit", "id": rid, "prompt_token_ids": prompt_token_ids,
                                "params": dict(params), "cache_salt": cache_salt, "perf": perf})
        session = self._live_session()
        session.register(rid, handler)
        try:
            session.send(frame)
        except OSError as exc:
            if session.unregister(rid):
                session.kill(P.LOST_MESSAGE)
                raise P.EngineUnavailableError(f"engine process unavailable: {exc}") from exc
        return rid

    def steps(self) -> int:
        """Step frames received so far, over every connection (paces the CancelWatcher)."""
        return self._steps

    def _count_step(self) -> None:
        self._steps += 1  # only the live connection's reader thread counts

    def abort(self, rids: list[str]) -> None:
        """Best effort: a lost connection aborts its requests in the engine anyway."""
        session = self._session
        if not rids or session is None or session.dead:
            return
        try:
            session.send(P.encode_frame({"op": "abort", "ids": rids}))
        except OSError:
            pass

    def close(self) -> None:
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.kill("the model is being unloaded")


class Watched(Protocol):
    def is_cancelled(self) -> bool: ...

    def cancel(self) -> None: ...


class CancelWatcher:
    """One thread that checks every request in flight for cancellation, once per engine step.

    Replaces a polling loop per request. A check is an IPC round trip to
    tritonserver (both processes pay for it), and the engine can act on an
    abort only between steps, so checking a request more than once per step
    buys nothing: a sweep runs when `period_s` has passed AND the engine has
    sent a step frame since the last sweep (`steps()` counts them), or when
    `idle_s` has passed without one (requests still queued, a long prefill).
    Under load that is one check per request per step instead of one per
    period; the thread sleeps while nothing is in flight.
    """

    def __init__(self, period_s: float, steps: Callable[[], int], idle_s: float = IDLE_SWEEP_S) -> None:
        self.period_s, self.idle_s = period_s, max(period_s, idle_s)
        self._steps = steps
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

    def stop(self) -> None:
        self._stop.set()
        self._busy.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        seen, last = self._steps(), time.monotonic()
        while not self._stop.is_set():
            self._busy.wait()
            if self._stop.wait(self.period_s):
                return
            now, steps = time.monotonic(), self._steps()
            if steps == seen and now - last < self.idle_s:
                continue
            seen, last = steps, now
            with self._lock:
                items = list(self._items)
                if not items:
                    self._busy.clear()
            for item in items:
                self._check(item)

    def _check(self, item: Watched) -> None:
        try:
            if item.is_cancelled():
                item.cancel()
        except Exception:  # noqa: BLE001 - the watcher serves every request
            log.exception("cancellation check failed")

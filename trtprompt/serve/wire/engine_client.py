"""The client side of the engine protocol (Triton stubs and the OpenAI front end): one connection, one reader.

A Python-backend stub (one per model instance) holds ONE `EngineClient`: a
connection to the engine process that every request of the stub shares.
Submits and aborts go out on it; one reader thread takes the engine's
per-step frames and calls each entry's handler. A lost connection ends every
request in flight with an UNAVAILABLE error entry, and the next submit
reconnects (the launcher restarts a dead engine process).
docs/design.md, "Request path and engine process protocol".

Stdlib only (no Triton), so it runs and is tested outside the stub.
"""

from __future__ import annotations

import base64
import itertools
import logging
import select
import socket
import threading
import time
from typing import Any, Callable, Iterable, cast

from trtprompt.error_codes import ErrorCode
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.wire.frames import LogitsBlob, StepEntry, StepFrame
from trtprompt.serve.wire.outputs import logits_of
from trtprompt.serve.wire.requests import TokenRequest

log = logging.getLogger("trtprompt.relay")

# Called on the reader thread with each output entry of its request; the
# entry with "finished" true is the last call. Must not block for long:
# every other request of the stub waits behind it.
Handler = Callable[[StepEntry], None]
# A step frame read this long after the engine made it (its "t", time.monotonic(), a clock every
# process shares): the reader is behind, and merges the frames it read together (`coalesce`).
# Less behind, they are handled one by one: one token per entry, as TensorRT-LLM streams.
BEHIND_S = 0.25


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

    def unread(self) -> bool:
        """True when the engine has sent bytes the reader has not read yet (it is busy relaying).

        Asked from another thread: select() only looks, the reader still gets every byte."""
        try:
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):  # closed meanwhile: the reader ends its requests itself
            return False

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
                # JSON from the engine process, typed once here; values are checked where they are used
                steps = [cast(StepFrame, frame) for frame in reader.feed(self.sock) if frame.get("type") == "step"]
                for _ in steps:
                    self._on_step()
                if len(steps) > 1 and behind(steps[0]):
                    self._dispatch(coalesce(steps))
                else:  # in step: one entry per token, as TensorRT-LLM streams
                    for step in steps:
                        self._dispatch(step["outputs"])
        except (OSError, ValueError) as exc:
            log.warning("engine connection lost: %s", exc)
        self.kill(P.LOST_MESSAGE)
        self.sock.close()

    def _dispatch(self, entries: Iterable[StepEntry]) -> None:
        for entry in entries:
            with self._lock:
                rid = entry["id"]
                handler = self._handlers.pop(rid, None) if entry.get("finished") else self._handlers.get(rid)
            if handler is not None:
                _call(handler, entry)


def behind(step: StepFrame, now: float | None = None) -> bool:
    """True when the step frame was made more than BEHIND_S ago (a frame without "t": never)."""
    made = step.get("t")
    return made is not None and (time.monotonic() if now is None else now) - float(made) > BEHIND_S


def coalesce(steps: Iterable[StepFrame]) -> list[StepEntry]:
    """The entries of step frames that were read together, one per request, in first-seen order.

    Frames pile up only when this reader is behind the engine (BEHIND_S); each entry
    then costs its handler a response (an IPC send in a stub), so a reader
    that handled them one by one stayed behind: measured, with 64 streams
    on 2 cores the stub read the engine's output 3-8 s late, so a client
    that cancelled after seeing 60 tokens cancelled a request the engine had
    already run to max_tokens. Merged, a request's tokens of all the frames
    cost one handler call, and the lag cannot grow. A sequence's tokens, log
    probabilities and generation logits join; a later entry's counts,
    stats and finish fields supersede the earlier ones; an error entry
    replaces the request's tokens (the request ends with the error anyway).
    """
    merged: dict[tuple[str, int], StepEntry] = {}
    for step in steps:
        for entry in step["outputs"]:
            key = (entry["id"], int(entry.get("seq", 0)))  # a request's sequences (n > 1) merge apart
            prev = merged.get(key)
            if prev is None or entry.get("error") is not None:
                merged[key] = entry
            elif prev.get("error") is None:
                _merge(prev, entry)
    # A request's finishing entry comes after its other sequences' (its handler is dropped there).
    ordered = sorted(merged.values(), key=lambda e: bool(e.get("finished")))
    _prompt_extras_first(ordered)
    return ordered


def _prompt_extras_first(entries: list[StepEntry]) -> None:
    """Move the prompt's log probabilities to their request's first entry: sequence 0 carries them, but
    its merged entry may be the finishing one, sorted after its forks' entries, whose first pieces (echo)
    need them. (Context logits stay: they are sequence 0's output.)"""
    first: dict[str, StepEntry] = {}
    for entry in entries:
        head = first.setdefault(entry["id"], entry)
        if head is entry:
            continue
        if "prompt_logprobs" in entry and "prompt_logprobs" not in head:
            head["prompt_logprobs"] = entry.pop("prompt_logprobs")


def _merge(prev: StepEntry, entry: StepEntry) -> None:
    """Fold a later entry of the same sequence into prev: tokens, log probabilities and generation
    logits join; every other key the later entry carries supersedes (a null prompt_logprobs never)."""
    joined = _joined_logits(prev, entry) if "generation_logits" in entry and "generation_logits" in prev else None
    prev["new_token_ids"].extend(entry["new_token_ids"])
    if "logprobs" in entry:
        prev.setdefault("logprobs", []).extend(entry["logprobs"])
    raw = cast(dict[str, Any], prev)  # the keys below are any of StepEntry's
    for key, value in entry.items():
        if key not in ("new_token_ids", "logprobs") and not (key == "prompt_logprobs" and value is None):
            raw[key] = value
    if joined is not None:
        prev["generation_logits"] = joined


def _joined_logits(first: StepEntry, then: StepEntry) -> LogitsBlob:
    """Two entries' generation_logits as one, their rows in order (base64 texts do not concatenate)."""
    a, b = logits_of(first, "generation_logits"), logits_of(then, "generation_logits")
    if a is None or b is None or a.cols != b.cols:  # a malformed frame, as the reader treats any (ValueError)
        raise ValueError(f"generation_logits of one sequence do not join: {a and a.cols} and {b and b.cols} columns")
    return {"rows": a.rows + b.rows, "cols": a.cols, "f32": base64.b64encode(a.data + b.data).decode("ascii")}


def _call(handler: Handler, entry: StepEntry) -> None:
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

    def submit(self, request: TokenRequest, handler: Handler) -> str:
        """Send one request; returns its id. Raises EngineError / EngineUnavailableError.

        After a successful return, handler gets every output entry of the
        request, the last one finished (an error entry included); after a
        raise, it gets nothing.
        """
        rid = str(next(self._ids))
        frame = P.encode_frame(request.to_wire(rid))
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

    def behind(self) -> bool:
        """True while step frames wait unread on the connection: the engine stepped, and this reader,
        busy relaying earlier frames, has not counted it in `steps()` yet (it may stay so for as
        long as relaying takes; paces the CancelWatcher, docs/design.md "Cancellation")."""
        session = self._session
        return session is not None and not session.dead and session.unread()

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

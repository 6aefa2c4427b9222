"""The engine process's local protocol: length-prefixed JSON over a unix socket.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON.
One connection per request: the client sends {"op": "submit", ...} and reads
frames until one is final; {"op": "abort"} (or closing the connection)
aborts it. {"op": "stats"} and {"op": "info"} are answered with one frame.

Stdlib only: the client side runs inside Triton's Python-backend stub.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass
from typing import Any, Mapping

_HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024

# Error codes carried in {"type": "error"} frames; the models map them to
# Triton's status codes.
INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
QUEUE_FULL = "QUEUE_FULL"
INTERNAL = "INTERNAL"


class EngineUnavailableError(ConnectionError):
    """The engine process cannot be reached (not started yet, restarting, dead)."""


@dataclass(frozen=True)
class EngineError(Exception):
    code: str
    message: str

    def __str__(self) -> str:
        return self.message


def encode_frame(message: Mapping[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    return _HEADER.pack(len(body)) + body


def send_frame(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall(encode_frame(message))


class FrameReader:
    """Accumulates bytes from a socket and yields whole frames.

    Works with select(): each `feed()` does one recv(), so a frame split over
    several reads is never blocked on, and frames already buffered are never
    left waiting for a readiness event that will not come.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self.closed = False

    def feed(self, sock: socket.socket) -> list[dict[str, Any]]:
        chunk = sock.recv(1 << 16)
        if not chunk:
            self.closed = True
        self._buf.extend(chunk)
        return self.drain()

    def push_front(self, frame: Mapping[str, Any]) -> None:
        self._buf[:0] = encode_frame(frame)

    def drain(self) -> list[dict[str, Any]]:
        frames: list[dict[str, Any]] = []
        while len(self._buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf)
            if size > MAX_FRAME:
                raise ValueError(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
            if len(self._buf) < _HEADER.size + size:
                break
            body = bytes(self._buf[_HEADER.size:_HEADER.size + size])
            del self._buf[:_HEADER.size + size]
            frames.append(json.loads(body.decode("utf-8")))
        return frames


def recv_frame(sock: socket.socket, reader: FrameReader | None = None) -> dict[str, Any]:
    """Blocking read of the next frame (for one-shot request/reply ops)."""
    reader = reader or FrameReader()
    frames = reader.drain()
    while not frames:
        if reader.closed:
            raise EngineUnavailableError("engine process closed the connection")
        frames = reader.feed(sock)
    # One-shot ops send exactly one frame before a reply; keep any extra for later reads.
    for extra in reversed(frames[1:]):
        reader.push_front(extra)
    return frames[0]


def connect(path: str, timeout: float | None = 5.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise EngineUnavailableError(
            f"engine process unavailable (it is not running or is restarting): {exc.strerror or exc}"
        ) from exc
    sock.settimeout(None)
    return sock


def call(path: str, message: Mapping[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """One request/reply op (info, stats, ping)."""
    sock = connect(path, timeout)
    try:
        sock.settimeout(timeout)
        send_frame(sock, message)
        reply = recv_frame(sock)
    except OSError as exc:
        raise EngineUnavailableError(f"engine process unavailable: {exc}") from exc
    finally:
        sock.close()
    if reply.get("type") == "error":
        raise EngineError(reply.get("code", INTERNAL), reply.get("message", "engine error"))
    return reply


class EngineRequest:
    """One submitted request: a connection whose frames are the request's outputs."""

    def __init__(self, path: str, request_id: str, prompt_token_ids: list[int],
                 params: Mapping[str, Any], cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.sock = connect(path)
        self.reader = FrameReader()
        self.finished = False
        try:
            send_frame(self.sock, {"op": "submit", "request_id": request_id,
                                   "prompt_token_ids": prompt_token_ids, "params": dict(params),
                                   "cache_salt": cache_salt})
        except OSError as exc:
            self.sock.close()
            raise EngineUnavailableError(f"engine process unavailable: {exc}") from exc

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[dict[str, Any]]:
        """Frames available now (call when select() says readable).

        An error frame raises EngineError; a connection lost before the final
        output raises EngineUnavailableError.
        """
        try:
            frames = self.reader.feed(self.sock)
        except OSError as exc:
            raise EngineUnavailableError(f"lost the engine process: {exc}") from exc
        for frame in frames:
            if frame.get("type") == "error":
                self.finished = True
                raise EngineError(frame.get("code", INTERNAL), frame.get("message", "engine error"))
            if frame.get("finished"):
                self.finished = True
        if self.reader.closed and not self.finished:
            raise EngineUnavailableError(
                "the engine process stopped while generating (it is being restarted); retry the request")
        return frames

    def abort(self) -> None:
        try:
            send_frame(self.sock, {"op": "abort"})
        except OSError:
            pass  # the engine aborts a request whose connection closes anyway

    def close(self) -> None:
        self.sock.close()

"""The engine process's local protocol: length-prefixed JSON over a unix socket.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON.
Each Python-backend stub keeps ONE connection open and multiplexes all its
requests over it; the engine process answers with ONE frame per engine step
carrying every output of that step for that connection's requests. The
frames and their fields are written down in docs/design.md ("Request path
and engine process protocol"); the stub's side lives in relay.py, the
engine's in engine_server.py.

Stdlib only: the client side runs inside Triton's Python-backend stub.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any, Mapping

from trtprompt.error_codes import ErrorCode, RequestError, UnavailableError, parse_code

_HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024

# Short names of the codes error entries and {"type": "error"} replies carry
# (their statuses: trtprompt/error_codes.py).
INVALID_ARG = ErrorCode.INVALID_ARGUMENT
UNAVAILABLE = ErrorCode.UNAVAILABLE
QUEUE_FULL = ErrorCode.QUEUE_FULL
INTERNAL = ErrorCode.INTERNAL

# What a request in flight is told when its connection to the engine process
# breaks; the launcher restarts a dead engine process.
LOST_MESSAGE = "the engine process stopped while generating (it is being restarted); retry the request"


class EngineUnavailableError(UnavailableError, ConnectionError):
    """The engine process cannot be reached (not started yet, restarting, dead)."""


class EngineError(RequestError):
    """An error entry or reply of the engine process, with the code it carried (INTERNAL: a fault
    of the engine process, already logged there with its traceback)."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None) -> None:
        super().__init__(message, code)
        self.message = message
        self.field = field  # the request field to blame, where the engine process named one


def encode_frame(message: Mapping[str, Any]) -> bytes:
    """Header + JSON body; a body over MAX_FRAME raises EngineError(INVALID_ARG).

    Checked on the sending side so that one oversized request is refused
    alone instead of making the peer drop the connection every other request
    of the stub shares.
    """
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_FRAME:
        raise EngineError(INVALID_ARG, f"the request is {len(body)} bytes once encoded, over the engine "
                                       f"protocol's limit of {MAX_FRAME} bytes per message")
    return _HEADER.pack(len(body)) + body


def send_frame(sock: socket.socket, message: Mapping[str, Any]) -> None:
    sock.sendall(encode_frame(message))


class FrameReader:
    """Accumulates bytes from a socket and yields whole frames.

    Each `feed()` does one recv(), so a frame split over several reads is
    never blocked on and several frames that arrived together come out of
    one call.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self.closed = False

    def feed(self, sock: socket.socket) -> list[dict[str, Any]]:
        chunk = sock.recv(1 << 18)
        if not chunk:
            self.closed = True
        self._buf.extend(chunk)
        return self.drain()

    def drain(self) -> list[dict[str, Any]]:
        frames: list[dict[str, Any]] = []
        start = 0
        while len(self._buf) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf, start)
            if size > MAX_FRAME:
                raise ValueError(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
            end = start + _HEADER.size + size
            if len(self._buf) < end:
                break
            frames.append(json.loads(self._buf[start + _HEADER.size:end]))
            start = end
        del self._buf[:start]
        return frames


def recv_frame(sock: socket.socket, reader: FrameReader | None = None) -> dict[str, Any]:
    """Blocking read of the next frame (for one-shot request/reply ops)."""
    reader = reader or FrameReader()
    frames = reader.drain()
    while not frames:
        if reader.closed:
            raise EngineUnavailableError("engine process closed the connection")
        frames = reader.feed(sock)
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


def engine_limits(path: str) -> tuple[int, int]:
    """(max_input_len, max_seq_len) of the engine process at path (the prompt edge's bounds)."""
    info = call(path, {"op": "info"})
    return int(info["max_input_len"]), int(info["max_seq_len"])


def call(path: str, message: Mapping[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """One request/reply op (info, stats) on a connection of its own."""
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
        raise EngineError(parse_code(reply.get("code")), reply.get("message", "engine error"))
    return reply


def entry_error(entry: Mapping[str, Any]) -> EngineError | None:
    """The error an output entry carries, if it is an error entry."""
    if entry.get("error") is None:
        return None
    field = entry.get("field")
    return EngineError(parse_code(entry.get("code")), entry["error"], field if isinstance(field, str) else None)

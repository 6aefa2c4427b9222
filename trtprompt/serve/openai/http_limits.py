"""The front end's limits at the HTTP edge, and the request-body limit (an ASGI middleware).

The body limit is checked before a byte of the body is read: a `Content-Length`
over it is answered 413 at once (the body is never read, and the connection is
closed so the rest is not either); a chunked body is counted as it arrives and
cut with 413 at the limit. Header size, read and keep-alive timeouts and the
connection cap are enforced by the HTTP protocol itself (http_protocol.py and
uvicorn's own settings), since the application only sees a request once its
headers are complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, MutableMapping

from trtprompt.engine.engine_dir import load_engine_config
from trtprompt.serve.openai.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# A prompt token is ~4 bytes of text; JSON may escape each character as \uXXXX (6 bytes, 12 for
# a surrogate pair), so 16 bytes a token bounds any prompt the engine can take, and 1 MiB of
# headroom covers the rest of a body (chat framing, stop strings, metadata).
BYTES_PER_INPUT_TOKEN = 16
BODY_HEADROOM_BYTES = 1 << 20
MAX_HEADER_BYTES = 64 << 10  # request line + all headers; browsers and proxies stay under 16 KiB
READ_TIMEOUT_S = 30.0  # a whole request (headers and body) must arrive within this
KEEP_ALIVE_TIMEOUT_S = 5  # uvicorn's default: an idle keep-alive connection is closed after this
MAX_CONNECTIONS = 512  # uvicorn's limit_concurrency: past it, new requests get 503


def default_max_request_bytes(max_input_len: int) -> int:
    return max_input_len * BYTES_PER_INPUT_TOKEN + BODY_HEADROOM_BYTES


def engine_max_request_bytes(engine_dir: str | Path) -> int:
    """The default for an engine directory: from its build's max_input_len (max_seq_len if absent)."""
    build = load_engine_config(Path(engine_dir).resolve())["build_config"]
    return default_max_request_bytes(int(build.get("max_input_len") or build["max_seq_len"]))


@dataclass(frozen=True)
class HttpLimits:
    """What one front end accepts from a connection before its application sees a request."""

    max_request_bytes: int
    max_header_bytes: int = MAX_HEADER_BYTES
    read_timeout_s: float = READ_TIMEOUT_S
    keep_alive_timeout_s: int = KEEP_ALIVE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_header_bytes", "keep_alive_timeout_s", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_header_bytes < 1024:  # a request line and a few ordinary headers must fit
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if not 0 < self.read_timeout_s <= 3600:
            raise ValueError(f"read_timeout_s must be in (0, 3600], got {self.read_timeout_s!r}")


class BodyTooLarge(APIError):
    """413; the connection is closed, since the rest of the body is left unread."""

    def __init__(self, limit: int, length: int | None = None) -> None:
        said = f" (Content-Length {length})" if length is not None else ""
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes{said}; "
                         "see --max-request-bytes", "invalid_request_error", None, "request_too_large",
                         {"Connection": "close"})


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The announced body length; ValueError if it is not a number (the parser lets few through)."""
    for name, value in headers:
        if name == b"content-length":
            if not value.strip().isdigit():
                raise ValueError(value)
            return int(value)
    return None


async def send_error(send: Send, exc: APIError) -> None:
    """exc as a whole response, straight through ASGI (no Starlette here)."""
    body = json.dumps(exc.body()).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _counting(receive: Receive, limit: int) -> Receive:
    """receive, raising BodyTooLarge once more than limit body bytes have come."""
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return counted


class BodyLimit:
    """ASGI middleware: 413 for a body over max_bytes, decided on Content-Length before reading."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            length = _content_length(scope["headers"])
        except ValueError:
            await send_error(send, APIError(400, "Content-Length must be a number", "invalid_request_error",
                                            None, "invalid_request", {"Connection": "close"}))
            return
        if length is not None and length > self.max_bytes:
            await send_error(send, BodyTooLarge(self.max_bytes, length))
            return
        await self.app(scope, _counting(receive, self.max_bytes), send)


"""uvicorn's httptools protocol with the limits it lacks: header bytes and a read deadline.

Measured on uvicorn 0.55 / httptools 0.9 (tests/test_openai_security.py): its parser
buffers a header of any size (an 8 MB `Authorization` is read whole, copied on the way),
and no timer runs until a first response is sent (`timeout_keep_alive` is armed only
then), so a client that opens a connection and sends nothing, or a header a byte at a
time, holds it for ever. h11 has `h11_max_incomplete_event_size` but no read timeout
either, and is slower; so this subclass keeps httptools and adds both:

- the request line and headers may be at most `max_header_bytes`: the bytes are counted
  before the parser sees them, and the first byte past the limit is never parsed (431);
- each request, from its first byte (or the connection's opening) to its body's last,
  must arrive within `read_timeout_s` (408, connection closed).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from http import HTTPStatus
from typing import Any, Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from trtprompt.serve.openai.errors import APIError
from trtprompt.serve.openai.http_limits import HttpLimits

log = logging.getLogger("trtprompt.openai")


def raw_response(exc: APIError) -> bytes:
    """exc as the bytes of a whole HTTP/1.1 response that closes the connection."""
    body = json.dumps(exc.body()).encode("utf-8")
    head = (f"HTTP/1.1 {exc.status} {HTTPStatus(exc.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("latin-1") + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One connection; see the module docstring for what is added."""

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._header_bytes = 0  # of the request being read, until its headers are complete
        self._headers_done = False
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_timer()  # a connection that never sends a byte is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._headers_done:
            super().data_received(data)
            return
        room = self.limits.max_header_bytes - self._header_bytes
        if len(data) <= room:
            self._header_bytes += len(data)
            super().data_received(data)
            return
        # Feed only what still fits: the headers must end in it, or nothing more is parsed.
        self._header_bytes += room
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if not self._headers_done:
            self._refuse(APIError(431, f"the request line and headers are larger than this server's limit "
                                  f"of {self.limits.max_header_bytes} bytes", "invalid_request_error",
                                  None, "headers_too_large"), "headers too large")
            return
        super().data_received(data[room:])

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._headers_done = False
        self._arm_read_timer()

    def on_headers_complete(self) -> None:
        self._headers_done = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._cancel_read_timer()  # the whole request is in: answering it may take as long as it takes
        self._header_bytes, self._headers_done = 0, False

    def _arm_read_timer(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        self._refuse(APIError(408, f"the request did not arrive within {self.limits.read_timeout_s:g}s",
                              "invalid_request_error", None, "request_timeout"),
                     f"request not read within {self.limits.read_timeout_s:g}s")

    def _refuse(self, exc: APIError, why: str) -> None:
        """Answer exc (unless a response is already under way) and close the connection."""
        if self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning("openai front end: closed the connection of %s: %s", client, why)
        cycle = self.cycle  # this request's once its headers are in, else the previous one's (or None)
        if self._headers_done:
            answer = not cycle.response_started  # e.g. a 413 already went out for this request
        else:
            answer = cycle is None or cycle.response_complete  # a pipelined previous answer still going
        if answer:
            self.transport.write(raw_response(exc))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the application's receive() now says http.disconnect
            cycle.message_event.set()
        self.transport.close()


def guarded_protocol(limits: HttpLimits) -> Callable[..., GuardedHttpToolsProtocol]:
    """What to pass uvicorn as `http=` (it calls it with config, server_state and app_state)."""
    return functools.partial(GuardedHttpToolsProtocol, limits=limits)

"""Relay one Triton request's engine requests back to its response sender.

A Triton request may carry several rows (batch); each becomes one engine
request on its own connection. One thread per Triton request waits on all
of them with select(), and between reads checks whether the client has
cancelled, so an abort reaches the engine within one check period.
"""

from __future__ import annotations

import selectors
from typing import Any, Callable, Sequence

from trtprompt.serve.protocol import EngineRequest

OnFrame = Callable[[int, dict[str, Any]], None]


class Cancelled(Exception):
    """The client cancelled the request; the engine requests were aborted."""


def abort_all(requests: Sequence[EngineRequest]) -> None:
    for req in requests:
        if not req.finished:
            req.abort()
        req.close()


def relay(requests: Sequence[EngineRequest], on_frame: OnFrame,
          is_cancelled: Callable[[], bool], check_period_s: float) -> None:
    """Feed every frame to on_frame(row, frame) until all rows finish.

    Raises Cancelled, or the EngineError / EngineUnavailableError of the
    first row that fails; the other rows are aborted either way.
    """
    sel = selectors.DefaultSelector()
    for row, req in enumerate(requests):
        sel.register(req, selectors.EVENT_READ, row)
    pending = len(requests)
    try:
        while pending:
            events = sel.select(timeout=check_period_s)
            if is_cancelled():
                raise Cancelled()
            for key, _mask in events:
                req: EngineRequest = key.fileobj  # type: ignore[assignment]
                for frame in req.read():
                    on_frame(key.data, frame)
                if req.finished:
                    sel.unregister(req)
                    req.close()
                    pending -= 1
    finally:
        sel.close()
        abort_all(requests)

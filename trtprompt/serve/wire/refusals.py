"""Requests refused at the edge, before they became engine requests: their `reason` label, and the
report that tells the engine process (which holds every count for /metrics) about one.

Called from the Triton stubs and the OpenAI front end; stdlib only.
"""

from __future__ import annotations

import os

from trtprompt.error_codes import ErrorCode, code_of
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.wire.process import SOCKET_ENV

_CODE_REASONS = {ErrorCode.QUEUE_FULL: "rejected_queue_full", ErrorCode.INVALID_ARGUMENT: "invalid",
                 ErrorCode.TOO_LONG: "invalid", ErrorCode.CANCELLED: "aborted"}


def error_reason(code: ErrorCode | None) -> str:
    """The `reason` label of a request that ended with an error of this code."""
    return _CODE_REASONS.get(code, "error") if code is not None else "error"


def refusal_reason(exc: BaseException) -> str:
    """The `reason` label of a request a serving model refused with exc."""
    return error_reason(code_of(exc, None))



def report_refused(reason: str, socket_path: str | None = None) -> None:
    """Tell the engine process a serving model refused a request (best effort, never raises).

    Refusals are rare and this runs on the refusing request's own thread, so a
    short-lived connection is fine; the engine process holds every count.
    """
    path = socket_path or os.environ.get(SOCKET_ENV)
    if not path:
        return
    try:
        sock = P.connect(path, timeout=1.0)
    except P.EngineUnavailableError:
        return
    try:
        P.send_frame(sock, {"op": "refused", "reason": reason})
    except OSError:
        pass
    finally:
        sock.close()

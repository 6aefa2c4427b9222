"""Request error codes and what each one is answered with, on every surface: the one table.

An error carries its `ErrorCode` from where it is raised (engine admission,
the engine loop, the serving edge's input parsing) through the engine
process's protocol (the "code" of an error entry) to the Triton status the
Python-backend stub answers with and the HTTP status of the OpenAI front end.

Triton's gRPC stream carries an error's message only, no status code
(docs/design.md, "Errors"), so the stub starts every message it sends with
the code as a tag, "[queue_full] queue full: ...", and the OpenAI front end
reads the code back from the tag (`split_tag`) instead of guessing from the
words. Messages nobody here wrote (tritonserver's own, the tensorrtllm
backend's) carry no tag; `FOREIGN_MESSAGES` classifies the few that are not
bad input.

Standard library only: the engine, the Triton stub and the front end all
import it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping


class ErrorCode(str, enum.Enum):
    """Why a request failed; the value is what the protocol and the tag carry."""

    INVALID_ARGUMENT = "invalid_argument"  # the request itself is wrong: fix it, do not retry
    TOO_LONG = "too_long"  # the prompt exceeds the engine's maximum input length
    QUEUE_FULL = "queue_full"  # max_queue_size requests already wait: retry later
    UNAVAILABLE = "unavailable"  # the engine process is (re)starting or stopping: retry
    CANCELLED = "cancelled"  # the client cancelled the request
    INTERNAL = "internal"  # a fault of the server; other requests go on


@dataclass(frozen=True)
class Status:
    """What one code is answered with."""

    triton: str  # the pb_utils.TritonError code's name
    http: int  # the OpenAI front end's HTTP status
    openai_type: str  # OpenAI's error "type"
    openai_code: str | None  # OpenAI's error "code"
    retry: bool  # answered with Retry-After: the same request may succeed later


STATUSES: Mapping[ErrorCode, Status] = MappingProxyType({
    ErrorCode.INVALID_ARGUMENT: Status("INVALID_ARG", 400, "invalid_request_error", None, False),
    ErrorCode.TOO_LONG: Status("INVALID_ARG", 400, "invalid_request_error", None, False),
    ErrorCode.QUEUE_FULL: Status("UNAVAILABLE", 429, "rate_limit_error", "queue_full", True),
    ErrorCode.UNAVAILABLE: Status("UNAVAILABLE", 503, "service_unavailable", "engine_unavailable", True),
    # nginx's "client closed request": only a client that is already gone is answered so.
    ErrorCode.CANCELLED: Status("CANCELLED", 499, "invalid_request_error", "cancelled", False),
    ErrorCode.INTERNAL: Status("INTERNAL", 500, "server_error", "internal_error", False),
})

# Untagged messages (tritonserver's own, the tensorrtllm backend's), lower case -> code;
# anything else untagged is bad input, as tritonserver answers it.
FOREIGN_MESSAGES: tuple[tuple[str, ErrorCode], ...] = (
    ("exceeds maximum queue size", ErrorCode.QUEUE_FULL),  # tritonserver's own request queue
    ("prompt length", ErrorCode.TOO_LONG),  # TensorRT-LLM's "Prompt length (X) exceeds maximum input length (Y)"
)

_TAG = re.compile(r"\[(" + "|".join(c.value for c in ErrorCode) + r")\] ")


class RequestError(Exception):
    """A request answered with an error that is not the server's fault; the message is meant for
    the client. Deliberately not a ValueError: a bug that raises ValueError (or TypeError,
    KeyError) inside the server is an internal error, logged with its traceback, and never
    answered as if the client had sent something wrong."""

    code: ErrorCode = ErrorCode.INVALID_ARGUMENT

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class BadRequestError(RequestError):
    """The request itself is wrong; `field` names the input when one is to blame."""

    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class FieldError(BadRequestError):
    """A request field outside its bound: "<field> <rule>".

    `field` and `rule` apart, so an edge can name its client's input
    instead of the field without parsing the message.
    """

    field: str

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field} {rule}", field)
        self.rule = rule


class OverBoundError(RequestError):
    """The prompt is longer than an engine bound allows (max_input_len, max_seq_len)."""

    code = ErrorCode.TOO_LONG


class CapacityError(RequestError):
    """The server is full (max_queue_size requests already wait): retry later."""

    code = ErrorCode.QUEUE_FULL


class UnavailableError(RequestError):
    """The engine is starting, restarting or stopping: retry."""

    code = ErrorCode.UNAVAILABLE


class CancelledRequestError(RequestError):
    """The client cancelled the request or went away."""

    code = ErrorCode.CANCELLED


def code_of(exc: BaseException, default: ErrorCode | None = ErrorCode.INTERNAL) -> ErrorCode | None:
    """The code a RequestError carries; anything else (a fault of the server) gets default."""
    return exc.code if isinstance(exc, RequestError) else default


def parse_code(value: object) -> ErrorCode:
    """A code read off the wire; an unknown or missing one is INTERNAL."""
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.INTERNAL


def describe(exc: BaseException) -> tuple[ErrorCode, str]:
    """The code a failure is answered with, and its message (no code: an internal error, named)."""
    code = code_of(exc, None)
    if code is None:
        return ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    return code, str(exc)


def tagged(code: ErrorCode, message: str) -> str:
    """The message as the stub sends it to Triton: the code first, as a tag."""
    return f"[{code.value}] {message}"


def split_tag(text: str) -> tuple[ErrorCode | None, str]:
    """(the tagged code or None, the text without the tag); the tag may follow a prefix of Triton's."""
    match = _TAG.search(text)
    if match is None:
        return None, text
    return ErrorCode(match.group(1)), text[:match.start()] + text[match.end():]


def classify(text: str) -> ErrorCode:
    """The code of an error message tritonserver relayed: its tag, else FOREIGN_MESSAGES."""
    code, _ = split_tag(text)
    if code is not None:
        return code
    lower = text.lower()
    return next((c for fragment, c in FOREIGN_MESSAGES if fragment in lower), ErrorCode.INVALID_ARGUMENT)

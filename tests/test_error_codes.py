"""The one table of error codes (trtprompt/error_codes.py) and the codes errors carry from where
they are raised. End to end through a real server: tests/test_bad_inputs.py (invalid_argument and
too_long, every documented case, over gRPC and Triton's HTTP), test_openai_limits.py (queue_full:
gRPC tag and HTTP 429; unavailable: 503) and test_openai_params.py (tags to OpenAI statuses)."""

from __future__ import annotations

import pytest

from trtprompt.engine.errors import (DuplicateRequestError, EngineRequestError, EngineStoppingError,
                                     InputTooLongError, QueueFullError)
from trtprompt.engine.request import SamplingParams
from trtprompt.error_codes import (STATUSES, BadRequestError, CancelledRequestError, CapacityError, ErrorCode,
                                   FieldError, OverBoundError, classify, code_of, parse_code, split_tag, tagged)
from trtprompt.prompt.budget import PromptError, PromptTooLongError
from trtprompt.serve.wire import protocol as P

# code -> (Triton status, HTTP status of the OpenAI front end, OpenAI code, Retry-After)
EXPECTED = {
    ErrorCode.INVALID_ARGUMENT: ("INVALID_ARG", 400, None, False),
    ErrorCode.TOO_LONG: ("INVALID_ARG", 400, None, False),
    ErrorCode.QUEUE_FULL: ("UNAVAILABLE", 429, "queue_full", True),
    ErrorCode.UNAVAILABLE: ("UNAVAILABLE", 503, "engine_unavailable", True),
    ErrorCode.CANCELLED: ("CANCELLED", 499, "cancelled", False),
    ErrorCode.INTERNAL: ("INTERNAL", 500, "internal_error", False),
}


def test_every_code_has_its_statuses() -> None:
    assert {code: (s.triton, s.http, s.openai_code, s.retry) for code, s in STATUSES.items()} == EXPECTED


@pytest.mark.parametrize("code", list(ErrorCode))
def test_the_tag_carries_the_code_through_any_prefix(code: ErrorCode) -> None:
    message = f"in ensemble 'ensemble', {tagged(code, 'what went wrong')}"
    assert split_tag(message) == (code, "in ensemble 'ensemble', what went wrong")
    assert classify(message) is code
    assert parse_code(code.value) is code  # as the protocol carries it


def test_untagged_messages_and_unknown_codes() -> None:
    assert classify("Exceeds maximum queue size") is ErrorCode.QUEUE_FULL  # tritonserver's own queue
    assert classify("unexpected shape for input 'x'") is ErrorCode.INVALID_ARGUMENT
    assert split_tag("[StatusCode.UNAVAILABLE] down") == (None, "[StatusCode.UNAVAILABLE] down")
    assert parse_code("NO_SUCH_CODE") is ErrorCode.INTERNAL and parse_code(None) is ErrorCode.INTERNAL


@pytest.mark.parametrize("exc, code", [
    (EngineRequestError("prompt is empty"), ErrorCode.INVALID_ARGUMENT),
    (DuplicateRequestError("request id 'a' is already in flight"), ErrorCode.INVALID_ARGUMENT),
    (InputTooLongError(3000, 2047), ErrorCode.TOO_LONG),
    (QueueFullError(64), ErrorCode.QUEUE_FULL),
    (EngineStoppingError("engine is shutting down"), ErrorCode.UNAVAILABLE),
    (PromptError("input 'overflow' must be one of ..."), ErrorCode.INVALID_ARGUMENT),
    (PromptTooLongError(3000, 2000, 2047, 47), ErrorCode.TOO_LONG),
    (BadRequestError("input 'input_ids' is empty", "input_ids"), ErrorCode.INVALID_ARGUMENT),
    (OverBoundError("input 'input_ids': Prompt length (9) exceeds ..."), ErrorCode.TOO_LONG),
    (CapacityError("full"), ErrorCode.QUEUE_FULL),
    (CancelledRequestError("request cancelled by the client"), ErrorCode.CANCELLED),
    (ValueError("a bug that raised ValueError"), ErrorCode.INTERNAL),
    (KeyError("a bug that raised KeyError"), ErrorCode.INTERNAL),
    (P.EngineUnavailableError("engine process unavailable"), ErrorCode.UNAVAILABLE),
    (P.EngineError(ErrorCode.QUEUE_FULL, "queue full: ..."), ErrorCode.QUEUE_FULL),
    (RuntimeError("a bug"), ErrorCode.INTERNAL),
])
def test_errors_carry_their_code_from_where_they_are_raised(exc: BaseException, code: ErrorCode) -> None:
    assert code_of(exc) is code


def test_sampling_params_name_the_refused_field() -> None:
    with pytest.raises(FieldError) as info:
        SamplingParams(top_k=-1)
    assert (info.value.field, info.value.rule, str(info.value)) == ("top_k", "must be >= 0, got -1",
                                                                      "top_k must be >= 0, got -1")
    with pytest.raises(FieldError) as info:
        SamplingParams(temperature=float("nan"))
    assert info.value.field == "temperature" and code_of(info.value) is ErrorCode.INVALID_ARGUMENT


def test_the_protocol_reads_codes_off_the_wire() -> None:
    error = P.entry_error({"id": "1", "finished": True, "error": "queue full: ...", "code": "queue_full"})
    assert isinstance(error, P.EngineError) and (error.code, str(error)) == (ErrorCode.QUEUE_FULL, "queue full: ...")
    assert P.entry_error({"id": "1", "finished": True, "new_token_ids": [3]}) is None

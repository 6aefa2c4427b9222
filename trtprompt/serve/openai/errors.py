"""OpenAI's error shape, answered for an error code with the status the one table gives.

Triton's gRPC stream carries an error's message only, no status code
(docs/openai.md), so the serving path tags each message with its code and
`from_triton` reads the tag back (trtprompt/error_codes.py: the codes, their
HTTP statuses, and the few untagged messages of tritonserver itself). gRPC
call failures (tritonserver itself unreachable) do carry a status code. The
engine path (to_engine.py) keeps errors typed to here: `from_error`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from trtprompt.error_codes import STATUSES, ErrorCode, classify, describe, split_tag

RETRY_AFTER_S = 1
# Ensemble input names in error messages -> the OpenAI parameter they come from.
_PARAMS = {"text_input": "prompt", "messages": "messages", "max_tokens": "max_tokens",
           "prompt length": "prompt", "cache_salt": "cache_salt", "stop_words": "stop", "top_k": "top_k",
           "top_p": "top_p", "temperature": "temperature", "min_tokens": "min_tokens", "seed": "seed",
           "extra_end_ids": "stop_token_ids", "input_ids": "prompt", "n": "n"}


@dataclass
class APIError(Exception):
    """An error answered in OpenAI's JSON shape with an HTTP status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"})


def api_error(code: ErrorCode, message: str, param: str | None = None) -> APIError:
    """The API error for a code: status, type and code from trtprompt/error_codes.py."""
    status = STATUSES[code]
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status.retry else {}
    return APIError(status.http, message, status.openai_type, param, status.openai_code, headers)


def unavailable(message: str) -> APIError:
    return api_error(ErrorCode.UNAVAILABLE, message)


def from_error(exc: BaseException) -> APIError:
    """The API error for a failure on the engine path, from its type: the code through the one status
    table, the param from the field it names (no text is tagged and read back on this path)."""
    code, message = describe(exc)
    if code is ErrorCode.TOO_LONG:
        return api_error(code, message, "prompt")
    if code is not ErrorCode.INVALID_ARGUMENT:
        return api_error(code, message)
    field = getattr(exc, "field", None)
    param = _PARAMS.get(field, field) if isinstance(field, str) else _param_of(message.lower())
    return api_error(code, message, param)


def from_triton(message: str) -> APIError:
    """The API error for an error the ensemble answered a request with (the tag's code)."""
    code = classify(message)
    text = _strip_prefix(split_tag(message)[1])
    if code is ErrorCode.TOO_LONG:
        return api_error(code, text, "prompt")
    if code is ErrorCode.INVALID_ARGUMENT:
        return api_error(code, text, _param_of(text.lower()))
    return api_error(code, text)


def _strip_prefix(message: str) -> str:
    """tritonclient prefixes stream errors with a status word ('[StatusCode...] ' or 'in ensemble ...')."""
    return re.sub(r"^\[[^\]]*\]\s*", "", message.strip())


def _param_of(lower: str) -> str | None:
    for name, param in _PARAMS.items():
        if name in lower:
            return param
    return None

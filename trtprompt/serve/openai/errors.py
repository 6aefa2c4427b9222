"""OpenAI's error shape and the mapping from Triton's errors to HTTP statuses.

Triton's gRPC stream carries an error's message only, no status code
(docs/openai.md), so a stream error is classified by the message texts the
serving path is known to use: the engine's queue-full refusal, the engine
process being away (restarting), and everything else the ensemble refuses as
bad input. gRPC call failures (tritonserver itself unreachable) do carry a
status code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

RETRY_AFTER_S = 1
# Message fragments -> (status, type, code). First match wins.
_TRITON_MESSAGES: tuple[tuple[str, int, str, str], ...] = (
    ("queue full", 429, "rate_limit_error", "queue_full"),
    ("exceeds maximum queue size", 429, "rate_limit_error", "queue_full"),  # Triton's own queue
    ("engine process unavailable", 503, "service_unavailable", "engine_unavailable"),
    ("engine process stopped", 503, "service_unavailable", "engine_unavailable"),
    ("lost the engine process", 503, "service_unavailable", "engine_unavailable"),
    ("internal error", 500, "server_error", "internal_error"),
)
# Ensemble input names in error messages -> the OpenAI parameter they come from.
_PARAMS = {"text_input": "prompt", "messages": "messages", "max_tokens": "max_tokens",
           "prompt length": "prompt", "cache_salt": "cache_salt", "stop_words": "stop", "top_k": "top_k",
           "top_p": "top_p", "temperature": "temperature", "min_tokens": "min_tokens", "seed": "seed"}


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


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", None, "engine_unavailable",
                    {"Retry-After": str(RETRY_AFTER_S)})


def from_triton(message: str) -> APIError:
    """The API error for an error the ensemble answered a request with."""
    text = _strip_prefix(message)
    lower = text.lower()
    for fragment, status, kind, code in _TRITON_MESSAGES:
        if fragment in lower:
            headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else {}
            return APIError(status, text, kind, None, code, headers)
    return bad_request(text, _param_of(lower), None)


def _strip_prefix(message: str) -> str:
    """tritonclient prefixes stream errors with a status word ('[StatusCode...] ' or 'in ensemble ...')."""
    return re.sub(r"^\[[^\]]*\]\s*", "", message.strip())


def _param_of(lower: str) -> str | None:
    for name, param in _PARAMS.items():
        if name in lower:
            return param
    return None

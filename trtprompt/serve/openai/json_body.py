"""The one place a request body becomes Python: Content-Type, UTF-8, JSON, and what JSON allows
that nothing after it can handle, each refused with a 400 naming the field.

- nesting: json's C scanner raises RecursionError ~1000 levels down, and anything that walks
  the value later (json.dumps of an error message, of the chat) may overflow at less; so no
  value may be nested deeper than MAX_DEPTH;
- integers longer than Python's int/str digit limit (4300 digits) raise ValueError inside
  the parser, which would not say where: they are kept as a marker and refused by path; the
  limit itself is left alone (it protects the whole process);
- lone surrogates (a JSON escape like "\\ud800" is valid JSON, but not a Unicode string):
  the first encode to UTF-8 (the tokenizer, the reply, the log) would raise;
- NaN and Infinity, which Python's json accepts and JSON does not.

The top-level object is read member by member so a failure inside one value names its key.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from trtprompt.serve.openai.errors import APIError, bad_request

MAX_DEPTH = 64  # an OpenAI body needs 4 (messages[i].content[j].text); metadata may use a few more
JSON_TYPES = ("application/json",)
_WS = re.compile(r"[ \t\n\r]*")
_MAX_PART_CHARS = 64  # a field path names keys, cut to this (a key may be as long as the body)


class ClientGone(Exception):
    """The client disconnected before its body arrived (nobody is left to answer)."""


@dataclass(frozen=True)
class _LongInt:
    """An integer literal too long to convert: refused by path once the body is parsed."""

    digits: int


def _int_limit() -> int:
    limit = sys.get_int_max_str_digits()
    return limit if limit > 0 else 4300  # 0: unlimited in this process; keep Python's default bound


def _parse_int(text: str) -> int | _LongInt:
    digits = len(text.lstrip("-"))
    return _LongInt(digits) if digits > _int_limit() else int(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _decoder() -> json.JSONDecoder:
    return json.JSONDecoder(parse_int=_parse_int, parse_constant=_no_constant)


def check_content_type(request: Request) -> None:
    """415 unless the body says it is JSON: a browser may POST text/plain or a form to any server
    without asking first (a CORS "simple request"); application/json it may not."""
    value = request.headers.get("content-type", "")
    media, _, params = value.partition(";")
    charset = params.strip().lower().replace(" ", "")
    if media.strip().lower() not in JSON_TYPES or charset not in ("", "charset=utf-8", 'charset="utf-8"'):
        shown = value[:100].encode("ascii", "backslashreplace").decode("ascii")
        raise APIError(415, f"Content-Type must be application/json (optionally ; charset=utf-8), got "
                       f"{shown!r}", "invalid_request_error", None, "unsupported_media_type")


async def read_json(request: Request) -> Any:
    """The request's body as checked JSON; APIError (415, 400, 413) or ClientGone."""
    check_content_type(request)
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientGone() from None
    return parse_json(raw)


def parse_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(f"the request body is not UTF-8: byte {exc.start} ({raw[exc.start]:#04x}) is invalid",
                       None) from None
    start, decoder = _WS.match(text).end(), _decoder()  # type: ignore[union-attr]
    if text.startswith("{", start):
        value = _members(decoder, text, start + 1)
    else:  # not an object: parse_request refuses it, naming what an object is needed for
        value, end = _value(decoder, text, start, None)
        _end(text, end)
    check_value(value)
    return value


def _invalid(message: str, param: str | None) -> APIError:
    return bad_request(message, param, "invalid_json")


def _value(decoder: json.JSONDecoder, text: str, idx: int, key: str | None) -> tuple[Any, int]:
    """One JSON value at idx and where it ends, with every failure named for key."""
    try:
        return decoder.raw_decode(text, idx)
    except RecursionError:
        raise _invalid(f"the request body is nested too deeply{_in(key)} (at most {MAX_DEPTH} levels)",
                       _param(key)) from None
    except ValueError as exc:  # JSONDecodeError, or parse_constant's NaN / Infinity
        raise _invalid(f"the request body is not valid JSON{_in(key)}: {exc}", _param(key)) from None


def _in(key: str | None) -> str:
    return f" in {_part(key)!r}" if key is not None else ""


def _param(key: str | None) -> str | None:
    return _part(key) if key is not None else None


def _expect(text: str, idx: int, chars: str, what: str) -> int:
    """idx past whitespace; JSON error unless the next character is one of chars."""
    idx = _WS.match(text, idx).end()  # type: ignore[union-attr]
    if idx >= len(text) or text[idx] not in chars:
        line, col = text.count("\n", 0, idx) + 1, idx - text.rfind("\n", 0, idx)
        raise _invalid(f"the request body is not valid JSON: expecting {what}: line {line} column {col} "
                       f"(char {idx})", None)
    return idx


def _members(decoder: json.JSONDecoder, text: str, idx: int) -> dict[str, Any]:
    """The top-level object whose '{' ends at idx, member by member."""
    out: dict[str, Any] = {}
    idx = _expect(text, idx, '"}', "a property name in double quotes or '}'")
    if text[idx] == "}":
        _end(text, idx + 1)
        return out
    while True:
        idx = _expect(text, idx, '"', "a property name in double quotes")
        try:
            key, idx = decoder.raw_decode(text, idx)  # a JSON string (_expect saw its '"'): a str
        except json.JSONDecodeError as exc:
            raise _invalid(f"the request body is not valid JSON: {exc}", None) from None
        idx = _expect(text, idx, ":", "':' delimiter") + 1
        value, idx = _value(decoder, text, _WS.match(text, idx).end(), key)  # type: ignore[union-attr]
        out[key] = value
        idx = _expect(text, idx, ",}", "',' or '}'")
        if text[idx] == "}":
            _end(text, idx + 1)
            return out
        idx += 1


def _end(text: str, idx: int) -> None:
    if _WS.match(text, idx).end() != len(text):  # type: ignore[union-attr]
        raise _invalid(f"the request body is not valid JSON: extra data after the value (char {idx})", None)


def _part(name: str) -> str:
    """A key as it may appear in a message: surrogates escaped, long keys cut."""
    safe = name.encode("utf-8", "backslashreplace").decode("utf-8")
    return safe if len(safe) <= _MAX_PART_CHARS else safe[:_MAX_PART_CHARS] + "..."


def _path(parts: tuple[Any, ...]) -> str | None:
    """'messages[0].content' for ("messages", 0, "content"); None for the body itself."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{_part(part)}" if out else _part(part))
    return out or None


def _bad_string(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_value(body: Any) -> None:
    """400 naming the path of the first value nested too deeply, a string (or key) holding a lone
    surrogate, or an integer too long; iterative, so the check itself cannot overflow."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(body, ())]
    while stack:
        value, parts = stack.pop()
        if len(parts) > MAX_DEPTH:
            where = _path(parts[:1])
            raise _invalid(f"{where or 'the request body'}: nested deeper than {MAX_DEPTH} levels", where)
        if isinstance(value, str):
            if _bad_string(value):
                raise _surrogate(parts)
        elif isinstance(value, _LongInt):
            where = _path(parts)
            raise bad_request(f"{where}: an integer of {value.digits} digits (at most {_int_limit()})", where)
        elif isinstance(value, dict):
            for key, item in value.items():
                if _bad_string(key):
                    raise _surrogate(parts + (key,))
                stack.append((item, parts + (key,)))
        elif isinstance(value, list):
            stack.extend((item, parts + (i,)) for i, item in enumerate(value))


def _surrogate(parts: tuple[Any, ...]) -> APIError:
    where = _path(parts)
    return bad_request(f"{where or 'the request body'}: a string holds a lone surrogate (a \\ud800-\\udfff "
                       "escape without its pair), which is not Unicode text", where, "invalid_unicode")

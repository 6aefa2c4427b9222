"""KV retention on the OpenAI endpoint: Anthropic-style `cache_control` marks on chat content parts,
and a plain body-level `retention` object, both turned into the engine's RetentionConfig
(TensorRT-LLM's semantics; docs/openai.md "Retention" has the table, docs/prefix-pool.md the engine side).

A mark `{"type": "ephemeral", "ttl": "5m" | "1h"}` on a content part asks that the prompt up to and
including that part stay cached: its tokens get CACHE_CONTROL_PRIORITY for the ttl. Where that prefix
ends in tokens is only known once the chat is rendered and fitted (the chat window may drop old turns),
so a mark is kept as (message, text of its content up to the part) and measured by `mark_ranges`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from trtprompt.engine.request import RETENTION_PRIORITY_DEFAULT, RetentionConfig, TokenRangeRetention
from trtprompt.error_codes import FieldError
from trtprompt.prompt.chat import split_turns
from trtprompt.serve.openai.errors import bad_request

# Anthropic's two ttls (its default is 5m) as durations: a block's priority lasts this long after
# each release, then reverts to the default (35).
CACHE_TTLS_MS: dict[str, int] = {"5m": 5 * 60 * 1000, "1h": 60 * 60 * 1000}
DEFAULT_TTL = "5m"
# High, yet under the maximum, so a client's explicit `retention` priority of 100 still outranks it.
CACHE_CONTROL_PRIORITY = 90
RETENTION_KEYS = ("priority", "duration_ms", "token_ranges", "decode_priority", "decode_duration_ms")
RANGE_KEYS = ("start", "end", "priority", "duration_ms")
# RetentionConfig's field names -> the body's, for its refusals (the whole-prompt form: no "token_ranges.").
CLIENT_FIELDS = {"token_ranges.token_start": "token_ranges.start", "token_ranges.token_end": "token_ranges.end"}
WHOLE_PROMPT_FIELDS = {"token_ranges.priority": "priority", "token_ranges.duration_ms": "duration_ms"}


@dataclass(frozen=True)
class CacheMark:
    """A cache_control mark: the chat's prefix through `content` of message `message` stays cached."""

    message: int  # index into the request's messages
    content: str  # that message's content up to and including the marked part
    duration_ms: int


def cache_mark(value: Any, where: str, message: int, content: str) -> CacheMark:
    """The mark a part's `cache_control` value asks for; 400 naming the field otherwise."""
    if not isinstance(value, dict) or set(value) - {"type", "ttl"}:
        raise bad_request(f"{where} must be an object {{\"type\": \"ephemeral\", \"ttl\": \"5m\" | \"1h\"}}, "
                          f"got {_shown(value)}", where)
    if value.get("type") != "ephemeral":
        raise bad_request(f"{where}.type must be \"ephemeral\", got {_shown(value.get('type'))}", f"{where}.type")
    ttl = value.get("ttl", DEFAULT_TTL)
    if not isinstance(ttl, str) or ttl not in CACHE_TTLS_MS:
        raise bad_request(f"{where}.ttl must be one of {', '.join(CACHE_TTLS_MS)}, got {_shown(ttl)}", f"{where}.ttl")
    return CacheMark(message, content, CACHE_TTLS_MS[ttl])


def parse_retention(body: Mapping[str, Any]) -> RetentionConfig | None:
    """The body's `retention` (docs/openai.md, "Retention"), checked by RetentionConfig's own bounds."""
    raw = body.get("retention")
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - set(RETENTION_KEYS):
        raise bad_request(f"retention must be an object of {', '.join(RETENTION_KEYS)}, got {_shown(raw)}",
                          "retention")
    if "token_ranges" in raw and ("priority" in raw or "duration_ms" in raw):
        raise bad_request("retention: give either priority / duration_ms (the whole prompt) or token_ranges",
                          "retention.token_ranges")
    whole = "priority" in raw or "duration_ms" in raw
    try:
        return RetentionConfig(_ranges(raw, whole), _int(raw, "decode_priority", RETENTION_PRIORITY_DEFAULT),
                               _int(raw, "decode_duration_ms", None))
    except FieldError as exc:
        field = (WHOLE_PROMPT_FIELDS if whole else CLIENT_FIELDS).get(exc.field, exc.field)
        raise bad_request(f"retention.{field} {exc.rule}", f"retention.{field}") from None


def _ranges(raw: Mapping[str, Any], whole: bool) -> tuple[TokenRangeRetention, ...]:
    if whole:  # one range over the whole prompt
        if raw.get("priority") is None:
            raise bad_request("retention.priority is required with retention.duration_ms", "retention.priority")
        return (TokenRangeRetention(0, None, raw["priority"], _int(raw, "duration_ms", None)),)
    ranges = raw.get("token_ranges")
    if ranges is None:
        return ()
    if not isinstance(ranges, list) or not all(isinstance(r, dict) and not set(r) - set(RANGE_KEYS)
                                                and "start" in r and "priority" in r for r in ranges):
        raise bad_request("retention.token_ranges must be a list of {\"start\", \"end\", \"priority\", "
                          "\"duration_ms\"} objects (start and priority required)", "retention.token_ranges")
    return tuple(TokenRangeRetention(r["start"], r.get("end"), r["priority"], r.get("duration_ms")) for r in ranges)


def _int(raw: Mapping[str, Any], name: str, default: int | None) -> Any:
    """raw[name] as given (RetentionConfig checks its type and bound), default when absent or null."""
    value = raw.get(name)
    return default if value is None else value


def with_marks(retention: RetentionConfig | None, marks: Sequence[CacheMark]) -> RetentionConfig | None:
    """Refuse prompt ranges given both ways: a body `retention` may add only decode settings to marks."""
    if marks and retention is not None and retention.token_ranges:
        raise bad_request("cache_control marks and retention's priority / token_ranges both give the prompt's "
                          "retention: give one (retention may add decode_priority / decode_duration_ms)",
                          "retention")
    return retention


def mark_ranges(marks: Sequence[CacheMark], messages: Sequence[Mapping[str, str]], dropped_turns: int,
                prefix_tokens: Callable[[list[dict[str, str]]], int]) -> tuple[TokenRangeRetention, ...]:
    """The token ranges the marks ask for, over the prompt as fitted: [previous end, end) per mark at
    its ttl, where end is the rendered length of the kept messages through the marked part
    (prefix_tokens renders a chat without the generation prompt). Marks in turns the chat window
    dropped are gone with their text."""
    head, turn_of = _turns(messages)
    ranges, start = [], 0
    for mark in sorted(marks, key=lambda m: (m.message, len(m.content))):
        turn = turn_of[mark.message]
        if turn is not None and turn < dropped_turns:
            continue
        kept = [dict(m) for i, m in enumerate(messages[:mark.message])
                if i < head or (turn_of[i] or 0) >= dropped_turns]
        end = prefix_tokens(kept + [{"role": messages[mark.message]["role"], "content": mark.content}])
        if end > start:
            ranges.append(TokenRangeRetention(start, end, CACHE_CONTROL_PRIORITY, mark.duration_ms))
            start = end
    return tuple(ranges)


def _turns(messages: Sequence[Mapping[str, str]]) -> tuple[int, list[int | None]]:
    """(leading system messages, each message's turn or None for those), by the chat window's own
    split (trtprompt.prompt.chat.split_turns)."""
    system, turns = split_turns([dict(m) for m in messages])
    return len(system), [None] * len(system) + [t for t, turn in enumerate(turns) for _ in turn]


def _shown(value: Any, limit: int = 80) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."

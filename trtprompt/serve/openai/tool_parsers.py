"""Tool calls in a model's output (docs/structured-outputs.md, "Tool-call and reasoning parsers"): the
calls each chat-template family writes, found in the text whole (`parse_tool_calls`) or as it streams
(`ToolCallStream`), and the content left outside them.

Families (`TOOL_PARSERS`):
- hermes (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
  block per call.
- llama3_json (Llama 3.1 / 3.2): `{"name": ..., "parameters": {...}}` at the start of the output or after
  `<|python_tag|>`, several separated by `;`.
- mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"}, or the newer `[TOOL_CALLS]name[ARGS]{...}`
  once per call.

Text that is not a well-formed call stays content: model output never raises. Whitespace next to a call
(the newline before `<tool_call>`, between calls) is dropped; content that is whitespace only is None.
Whole and streamed parses are one state machine, so a text gives the same calls and content however it
is split into deltas. `<|python_tag|>` and `[TOOL_CALLS]` are special tokens in their vocabularies: the
text parsed must be detokenized with them kept (skip_special_tokens off), as vLLM does for these families.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from trtprompt.serve.openai.reasoning import held_back

TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
# OpenAI's call ids: "call_" and 24 letters and digits.
_ID_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 24
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
# A function name in Mistral's `[TOOL_CALLS]name[ARGS]` form (OpenAI allows a-z, A-Z, 0-9, _ and -, up to
# 64; a dot is let through for namespaced tools). Anything else there means the marker was not a call.
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# The keys a call object may have besides its name and arguments (Llama writes "type": "function"
# now and then; Mistral's array may carry its own 9-character id, which OpenAI's id replaces).
_CALL_EXTRA_KEYS = frozenset({"type", "id"})


@dataclass(frozen=True)
class ToolCall:
    """One parsed call as OpenAI returns it: arguments are the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("ToolCall.id must be non-empty")
        if not self.name:
            raise ValueError("ToolCall.name must be non-empty")

    def message(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` item."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """A fresh OpenAI-style call id: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))


@dataclass(frozen=True)
class ContentDelta:
    """Text outside the calls, to stream as `delta.content`."""

    text: str

    def delta(self) -> dict[str, Any]:
        return {"content": self.text}


@dataclass(frozen=True)
class ToolCallStart:
    """The first delta of call `index`: its id, type and name, with empty arguments (as OpenAI streams it)."""

    index: int
    id: str
    name: str

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"ToolCallStart.index must be >= 0, got {self.index}")

    def delta(self) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.index, "id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": ""}}]}


@dataclass(frozen=True)
class ToolCallArguments:
    """A fragment of call `index`'s arguments; a call's fragments concatenate to ToolCall.arguments."""

    index: int
    arguments: str

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"ToolCallArguments.index must be >= 0, got {self.index}")

    def delta(self) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.index, "function": {"arguments": self.arguments}}]}


StreamEvent = ContentDelta | ToolCallStart | ToolCallArguments


def check_parser(parser: str) -> None:
    if parser not in TOOL_PARSERS:
        raise ValueError(f"tool call parser must be one of {', '.join(TOOL_PARSERS)}, got {parser!r}")


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """The content outside the calls (None when there is none but whitespace) and the calls of a whole output."""
    stream = ToolCallStream(parser)
    events = stream.feed(text) + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return (content or None), list(stream.calls)


def parser_for_template(chat_template: str | None) -> str | None:
    """The family whose calls a checkpoint's chat template asks for, or None when it speaks of none."""
    if not chat_template:
        return None
    if _HERMES_OPEN in chat_template:
        return "hermes"
    if _MISTRAL_CALLS in chat_template:
        return "mistral"
    if _PYTHON_TAG in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


def _call_parts(value: Any, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object, or None when the value is not one. Arguments may be an
    object or the JSON text of one (some models write a string)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    keys = [k for k in args_keys if k in value]
    if len(keys) != 1 or set(value) - {"name", keys[0]} - _CALL_EXTRA_KEYS:
        return None
    args = value[keys[0]]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _first_visible(text: str) -> int | None:
    """Index of the first non-whitespace character, None when there is none."""
    stripped = len(text) - len(text.lstrip())
    return stripped if stripped < len(text) else None


class _JsonExtent:
    """Where the JSON object or array at the start of a growing text ends, scanning each character once
    (strings and escapes followed, so a brace inside a string does not count)."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._scanned = 0

    def end(self, text: str) -> int | None:
        """Index just past the closing bracket, None while the value is open."""
        for i in range(self._scanned, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._scanned = i + 1
                    return i + 1
        self._scanned = len(text)
        return None


class _Machine:
    """What every family shares: the undecided text, the attempt at a call being read (`raw`, which becomes
    content if it fails), the content's whitespace rule and the calls made. A family's `step` consumes
    what it can decide and says whether it made progress; `flush` ends the text."""

    marker = ""

    def __init__(self) -> None:
        self.pending = ""
        self.raw = ""
        self.mode = "content"
        self.extent = _JsonExtent()
        self.calls: list[ToolCall] = []
        self.out: list[StreamEvent] = []
        self._ws = ""  # trailing whitespace of the content so far: dropped if a call follows
        self._after_call = False  # whitespace right after a call is dropped
        self._spoke = False  # some non-whitespace content went out

    def step(self) -> bool:
        raise NotImplementedError

    def flush(self) -> None:
        self.content(self.raw + self.pending)
        self.raw = self.pending = ""

    def run(self) -> list[StreamEvent]:
        while self.step():
            pass
        out, self.out = self.out, []
        return out

    def end(self) -> list[StreamEvent]:
        self.run()
        self.flush()
        if self._ws and self._spoke:
            self.out.append(ContentDelta(self._ws))
        self._ws = ""
        out, self.out = self.out, []
        return out

    def content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            self.out.append(ContentDelta(body))
            self._spoke = True

    def call(self, name: str, arguments: str) -> None:
        index = len(self.calls)
        self.calls.append(ToolCall(new_call_id(), name, arguments))
        self.out += [ToolCallStart(index, self.calls[-1].id, name), ToolCallArguments(index, arguments)]
        self._ws, self._after_call, self.raw = "", True, ""

    def fail(self) -> None:
        """The attempt was not a call: its text is content, and what follows is read as content again."""
        self.content(self.raw)
        self.raw, self.mode = "", "content"

    def start_json(self, mode: str) -> None:
        self.mode, self.extent = mode, _JsonExtent()

    def scan_content(self) -> bool:
        """Content up to the family's marker; True (the marker consumed into `raw`) when it appears."""
        i = self.pending.find(self.marker)
        if i < 0:
            keep = held_back(self.pending, self.marker)
            self.content(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        self.content(self.pending[:i])
        self.raw, self.pending = self.marker, self.pending[i + len(self.marker):]
        return True

    def take_json(self) -> str | None:
        """The JSON value at the start of `pending` once complete (moved into `raw`), else None."""
        end = self.extent.end(self.pending)
        if end is None:
            return None
        text, self.pending = self.pending[:end], self.pending[end:]
        self.raw += text
        return text


class _Hermes(_Machine):
    marker = _HERMES_OPEN

    def step(self) -> bool:
        if self.mode == "content":
            if self.scan_content():
                self.mode = "call"
                return True
            return False
        j = self.pending.find(_HERMES_CLOSE)
        if j < 0:
            return False
        body, self.pending = self.pending[:j], self.pending[j + len(_HERMES_CLOSE):]
        self.raw += body + _HERMES_CLOSE
        self._close(body)
        return True

    def flush(self) -> None:
        # A block the output ended inside is still a call when its JSON is whole (the model stopped early).
        if self.mode == "call":
            body, self.pending = self.pending, ""
            self.raw += body
            self._close(body)
        super().flush()

    def _close(self, body: str) -> None:
        parts = _call_parts(_loads(body), ("arguments", "parameters"))
        if parts is None:
            self.fail()
        else:
            self.call(*parts)
            self.mode = "content"


class _Llama3(_Machine):
    marker = _PYTHON_TAG

    def step(self) -> bool:
        if self.mode == "start":
            return self._start()
        if self.mode == "content":
            if self.scan_content():
                self.mode = "open"
                return True
            return False
        if self.mode in ("open", "after"):
            return self._between()
        text = self.take_json()
        if text is None:
            return False
        parts = _call_parts(_loads(text), ("parameters", "arguments"))
        if parts is None:
            self.fail()
        else:
            self.call(*parts)
            self.mode = "after"
        return True

    def _start(self) -> bool:
        """A call only where the output begins with one (or with the python tag): elsewhere a brace is text."""
        i = _first_visible(self.pending)
        if i is None:
            self.content(self.pending)
            self.pending = ""
            return False
        self.content(self.pending[:i])
        self.pending = self.pending[i:]
        if self.pending.startswith("{"):
            self.start_json("json")
        elif self.pending.startswith(_PYTHON_TAG):
            self.raw, self.pending, self.mode = _PYTHON_TAG, self.pending[len(_PYTHON_TAG):], "open"
        elif _PYTHON_TAG.startswith(self.pending):
            return False
        else:
            self.mode = "content"
        return True

    def _between(self) -> bool:
        """After the tag a call must follow; after a call, `;` and another call, or content."""
        i = _first_visible(self.pending)
        if i is None:
            return False
        ch = self.pending[i]
        if ch == ";" and self.mode == "after":
            self.raw, self.pending, self.mode = self.pending[:i + 1], self.pending[i + 1:], "open"
        elif ch == "{":
            self.raw += self.pending[:i]
            self.pending = self.pending[i:]
            self.start_json("json")
        elif self.mode == "open":
            self.fail()
        else:
            self.mode = "content"
        return True


class _Mistral(_Machine):
    marker = _MISTRAL_CALLS

    def __init__(self) -> None:
        super().__init__()
        self.name = ""  # the newer form's function name, read before its arguments

    def step(self) -> bool:
        if self.mode == "content":
            if self.scan_content():
                self.mode = "marker"
                return True
            return False
        if self.mode == "marker":
            return self._after_marker()
        if self.mode == "name":
            return self._name()
        if self.mode == "args":
            return self._args()
        text = self.take_json()
        if text is None:
            return False
        self._close(text)
        return True

    def _after_marker(self) -> bool:
        i = _first_visible(self.pending)
        if i is None:
            return False
        self.raw += self.pending[:i]
        self.pending = self.pending[i:]
        if self.pending.startswith("["):
            self.start_json("array")
        else:
            self.mode = "name"
        return True

    def _name(self) -> bool:
        """The newer form's name, up to `[ARGS]`; a character no name has means the marker was text."""
        j = self.pending.find(_MISTRAL_ARGS)
        name = self.pending[:j] if j >= 0 else self.pending[:len(self.pending) - held_back(self.pending, _MISTRAL_ARGS)]
        if (j >= 0 or name) and not _MISTRAL_NAME.fullmatch(name):
            self.fail()
            return True
        if j < 0:
            return False
        self.name = name
        self.raw += self.pending[:j + len(_MISTRAL_ARGS)]
        self.pending = self.pending[j + len(_MISTRAL_ARGS):]
        self.mode = "args"
        return True

    def _args(self) -> bool:
        i = _first_visible(self.pending)
        if i is None:
            return False
        if self.pending[i] != "{":
            self.fail()
            return True
        self.raw += self.pending[:i]
        self.pending = self.pending[i:]
        self.start_json("named")
        return True

    def _close(self, text: str) -> None:
        value = _loads(text)
        if self.mode == "named":
            calls = [(self.name, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else []
        elif isinstance(value, list) and value:
            parts = [_call_parts(v, ("arguments",)) for v in value]
            calls = [p for p in parts if p is not None] if None not in parts else []
        else:
            calls = []
        if not calls:
            self.fail()
            return
        for name, arguments in calls:
            self.call(name, arguments)
        self.mode = "content"


class ToolCallStream:
    """One request's streamed output, as content deltas and OpenAI tool-call deltas. Text that may start a
    call is held until decided; a call goes out (its start, then its arguments) once its JSON is whole."""

    def __init__(self, parser: str) -> None:
        check_parser(parser)
        self.parser = parser
        self._machine: _Machine = _Hermes() if parser == "hermes" else _Mistral() if parser == "mistral" \
            else _Llama3()
        if parser == "llama3_json":
            self._machine.mode = "start"
        self._finished = False

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """The calls found so far (finish_reason is "tool_calls" when there are any)."""
        return tuple(self._machine.calls)

    def feed(self, text_delta: str) -> list[StreamEvent]:
        if self._finished:
            raise ValueError("ToolCallStream.feed after finish")
        self._machine.pending += text_delta
        return self._machine.run()

    def finish(self) -> list[StreamEvent]:
        """The output ended: whatever was held is decided (an unclosed call is content)."""
        if self._finished:
            return []
        self._finished = True
        return self._machine.end()

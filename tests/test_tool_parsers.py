"""Tool-call parsers (serve/openai/tool_parsers.py): each family's calls and the content left outside them,
whole and streamed, the stream giving the same calls and content at every split of the text."""

from __future__ import annotations

import json
import re

import pytest

from trtprompt.serve.openai.tool_parsers import (
    TOOL_PARSERS,
    ContentDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolCallStream,
    new_call_id,
    parse_tool_calls,
    parser_for_template,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {}}'
TRICKY_ARGS = {"q": "a}b\"{ [", "city": "Zürich", "n": [1, {"k": None}]}
TRICKY = json.dumps({"name": "search", "arguments": TRICKY_ARGS}, ensure_ascii=False)


def llama(call: str) -> str:
    return call.replace('"arguments"', '"parameters"')


W_ARGS = '{"city": "Paris", "unit": "celsius"}'
T_ARGS = '{}'
X_ARGS = json.dumps(TRICKY_ARGS, ensure_ascii=False)

# (parser, text, content, [(name, arguments)]): outputs as the families write them, and near misses.
CASES = [
    ("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
     "Let me check.", [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("hermes", f"<tool_call>\n{TRICKY}\n</tool_call>", None, [("search", X_ARGS)]),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>\nDone.  ", "Done.  ", [("get_weather", W_ARGS)]),
    ("hermes", f"<tool_call>\n{TIME}", None, [("get_time", T_ARGS)]),  # the output ended inside the block
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None, [("f", '{"a": 1}')]),
    ("hermes", "Plain <b>text</b>, x < y and <tool_", "Plain <b>text</b>, x < y and <tool_", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call> after", "<tool_call>\n{not json}\n</tool_call> after", []),
    ("hermes", '<tool_call>\n{"name": "f"}\n</tool_call>', '<tool_call>\n{"name": "f"}\n</tool_call>', []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n[1, 2]\n</tool_call>",
     "<tool_call>\n[1, 2]\n</tool_call>", [("get_weather", W_ARGS)]),
    ("hermes", "  \n\n", None, []),
    ("hermes", "\n\nHi there\n", "\n\nHi there\n", []),
    ("llama3_json", f"<|python_tag|>{llama(WEATHER)}; {llama(TIME)}", None,
     [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("llama3_json", f"  {llama(TRICKY)}", None, [("search", X_ARGS)]),
    ("llama3_json", f"Sure! <|python_tag|>{llama(TIME)}", "Sure!", [("get_time", T_ARGS)]),
    ("llama3_json", f"{llama(TIME)}\nand then text", "and then text", [("get_time", T_ARGS)]),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", "The set {x} is <|python_ta", "The set {x} is <|python_ta", []),
    ("llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("llama3_json", f"{llama(TIME)};", ";", [("get_time", T_ARGS)]),
    ("llama3_json", '{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
    ("mistral", f"[TOOL_CALLS] [{WEATHER}, {TIME}]", None, [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("mistral", f"Calling it. [TOOL_CALLS][{TRICKY}]", "Calling it.", [("search", X_ARGS)]),
    ("mistral", f'[TOOL_CALLS]get_weather[ARGS]{W_ARGS}[TOOL_CALLS]get_time[ARGS]{{}}', None,
     [("get_weather", W_ARGS), ("get_time", T_ARGS)]),
    ("mistral", "Use [TOOL_CALLS] wisely", "Use [TOOL_CALLS] wisely", []),
    ("mistral", "[TOOL_CALLS]bad name[ARGS]{}", "[TOOL_CALLS]bad name[ARGS]{}", []),
    ("mistral", "[TOOL_CALLS]f[ARGS] 42", "[TOOL_CALLS]f[ARGS] 42", []),
    ("mistral", '[TOOL_CALLS][{"name": "f"}]', '[TOOL_CALLS][{"name": "f"}]', []),
    ("mistral", f"[TOOL_CALLS][{WEATHER}, 3]", f"[TOOL_CALLS][{WEATHER}, 3]", []),
    ("mistral", "[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea", []),
]


def _run(parser: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[object]]:
    """Stream the pieces; return the content, the calls as (name, joined argument fragments) checked
    against the stream's ToolCalls and OpenAI's delta order, and the events."""
    stream = ToolCallStream(parser)
    events: list[object] = []
    for piece in pieces:
        events += stream.feed(piece)
    events += stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == list(range(len(starts)))
    calls = []
    for s, call in zip(starts, stream.calls, strict=True):
        assert (s.id, s.name) == (call.id, call.name)
        after = events[events.index(s) + 1:]
        fragments = [e.arguments for e in after if isinstance(e, ToolCallArguments) and e.index == s.index]
        earlier = events[:events.index(s)]
        assert not any(isinstance(e, ToolCallArguments) and e.index == s.index for e in earlier)
        assert "".join(fragments) == call.arguments
        calls.append((call.name, call.arguments))
    return content, calls, events


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_whole_output(parser: str, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parse_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)
    for c in got_calls:
        assert isinstance(json.loads(c.arguments), dict)


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_stream_matches_whole_at_every_split(parser: str, text: str, content: str | None,
                                             calls: list[tuple[str, str]]) -> None:
    expected = (content or "", calls)
    assert _run(parser, list(text))[:2] == expected  # one character a delta
    for k in range(len(text) + 1):
        assert _run(parser, [text[:k], text[k:]])[:2] == expected, k


def test_marker_text_is_held_until_decided() -> None:
    stream = ToolCallStream("hermes")
    assert stream.feed("Hello <tool") == [ContentDelta("Hello")]
    assert stream.feed("_call>\n") == []
    assert stream.feed(WEATHER + "\n</tool_call") == []
    events = stream.feed(">")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArguments]
    assert events[1] == ToolCallArguments(0, W_ARGS)
    assert stream.finish() == []
    assert [c.name for c in stream.calls] == ["get_weather"]
    other = ToolCallStream("hermes")
    assert other.feed("a <t") == [ContentDelta("a")]
    assert other.feed("r>") == [ContentDelta(" <tr>")]


def test_deltas_are_openai_shaped() -> None:
    _, calls, events = _run("hermes", [f"<tool_call>\n{WEATHER}\n</tool_call>"])
    start, args = events
    assert isinstance(start, ToolCallStart) and isinstance(args, ToolCallArguments)
    assert start.delta() == {"tool_calls": [{"index": 0, "id": start.id, "type": "function",
                                             "function": {"name": "get_weather", "arguments": ""}}]}
    assert args.delta() == {"tool_calls": [{"index": 0, "function": {"arguments": W_ARGS}}]}
    assert ContentDelta("x").delta() == {"content": "x"}
    call = ToolCall(start.id, "get_weather", W_ARGS)
    assert call.message() == {"id": start.id, "type": "function",
                              "function": {"name": "get_weather", "arguments": W_ARGS}}


def test_call_ids() -> None:
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


def test_bad_use_is_refused() -> None:
    with pytest.raises(ValueError, match="tool call parser must be one of hermes, llama3_json, mistral"):
        ToolCallStream("pythonic")
    with pytest.raises(ValueError, match="ToolCall.name"):
        ToolCall("call_x", "", "{}")
    with pytest.raises(ValueError, match="index must be >= 0"):
        ToolCallStart(-1, "call_x", "f")
    stream = ToolCallStream("mistral")
    stream.finish()
    assert stream.finish() == []
    with pytest.raises(ValueError, match="after finish"):
        stream.feed("x")


def test_parser_for_template() -> None:
    assert TOOL_PARSERS == ("hermes", "llama3_json", "mistral")
    qwen = ("{%- if tools %}...<tool_call>\\n{\"name\": <function-name>, "
            "\"arguments\": <args-json-object>}\\n</tool_call>")
    llama31 = "{%- if message.role == \"ipython\" %}...{{- \"<|python_tag|>\" + tool_call.name }}"
    mistral_t = "{%- if message.tool_calls %}{{- \"[TOOL_CALLS] [\" }}"
    assert parser_for_template(qwen) == "hermes"
    assert parser_for_template(llama31) == "llama3_json"
    assert parser_for_template(mistral_t) == "mistral"
    assert parser_for_template("{% for message in messages %}<|im_start|>{% endfor %}") is None
    assert parser_for_template(None) is None

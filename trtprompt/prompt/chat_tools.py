"""Tools in a chat: the messages that carry tool calls and results, and how they reach the chat template.

A template with tool support (it names `tools`, as Qwen, Hermes, Llama 3.1 and Mistral templates do) is
rendered as transformers renders it: `tools=[...]` (the request's OpenAI function tools as given), the
assistant's `tool_calls` with their arguments as objects, `role: "tool"` messages as they are, and the
request's `chat_template_kwargs` (e.g. `enable_thinking`) beside them.

A template without (SmolLM2's, the demo checkpoints') gets the documented fallback (docs/structured-outputs.md,
"Tool calls"): the tools as a system-message preamble that describes the call format of the server's tool-call
parser (hermes unless set), the assistant's calls written back in that format into its content, and each run
of tool results as one user message (every template knows `user`; some refuse `tool`) holding
`<tool_response>` blocks. Pure: no tokenizer, no I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

# The formats a tool call is written in, by the name of the parser that reads it back
# (serve/openai/tool_parsers.py).
TOOL_FORMATS: tuple[str, ...] = ("hermes", "llama3_json", "mistral")
DEFAULT_TOOL_FORMAT = "hermes"
# Names the template context already binds: a chat_template_kwargs key may not replace them.
RESERVED_TEMPLATE_NAMES: tuple[str, ...] = ("messages", "add_generation_prompt", "tools", "documents",
                                            "bos_token", "eos_token")
_TOOLS_WORD = re.compile(r"\btools\b")


@dataclass(frozen=True)
class ChatRender:
    """What a chat's rendering takes besides its messages (the request's, checked where it came in)."""

    tools: tuple[Mapping[str, Any], ...] = ()  # OpenAI function tools: {"type": "function", "function": {...}}
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tool_format: str = DEFAULT_TOOL_FORMAT  # the fallback's call format (the server's tool-call parser)

    def __post_init__(self) -> None:
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format must be one of {', '.join(TOOL_FORMATS)}, got {self.tool_format!r}")
        clash = sorted(set(self.template_kwargs) & set(RESERVED_TEMPLATE_NAMES))
        if clash:
            raise ValueError(f"template_kwargs may not set {', '.join(clash)} (the renderer binds them)")


def knows_tools(template: str | None) -> bool:
    """Whether a chat template has tool support: it names `tools` (the argument transformers passes)."""
    return bool(template) and _TOOLS_WORD.search(template or "") is not None


def check_tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` in OpenAI's form, each {id, type: "function", function: {name,
    arguments}} with arguments a string (an object is accepted and written as JSON); ValueError naming
    where and what is wrong."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where} must be a non-empty list of tool calls")
    return [_tool_call(c, f"{where}[{i}]") for i, c in enumerate(raw)]


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise ValueError(f"{where} must be an object with 'id', 'type' and 'function'")
    if call.get("type", "function") != "function":
        raise ValueError(f"{where}.type must be \"function\", got {call.get('type')!r}")
    call_id, fn = call.get("id"), call.get("function")
    if not isinstance(call_id, str) or not call_id:
        raise ValueError(f"{where}.id must be a non-empty string")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function must be an object with a non-empty string 'name'")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise ValueError(f"{where}.function.arguments must be a string (JSON)")
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def tool_fields(item: Mapping[str, Any], role: str, where: str) -> dict[str, Any]:
    """A message's tool fields, checked: an assistant's `tool_calls`, a tool message's `tool_call_id` and
    `name` (the function's; another role's `name`, a participant's, is dropped as before); ValueError
    naming the field."""
    out: dict[str, Any] = {}
    if item.get("tool_calls") is not None:
        if role != "assistant":
            raise ValueError(f"{where}.tool_calls is only allowed on an assistant message, not {role!r}")
        out["tool_calls"] = check_tool_calls(item["tool_calls"], f"{where}.tool_calls")
    if item.get("tool_call_id") is not None and role != "tool":
        raise ValueError(f"{where}.tool_call_id is only allowed on a tool message, not {role!r}")
    for name in ("tool_call_id", "name") if role == "tool" else ():
        value = item.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where}.{name} must be a non-empty string")
        out[name] = value
    return out


def template_inputs(messages: Sequence[Mapping[str, Any]], template: str | None,
                    render: ChatRender | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the messages, the extra template arguments) to render a chat with: as they are for a template with
    tool support, the fallback's rewrite for one without."""
    render = render or ChatRender()
    kwargs = dict(render.template_kwargs)
    if knows_tools(template):
        if render.tools:
            kwargs["tools"] = [dict(t) for t in render.tools]
        return [_for_template(m) for m in messages], kwargs
    return fallback_messages(messages, render), kwargs


def _for_template(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message as tool-aware templates read it: content never null, call arguments as objects (templates
    write them with tojson; a string would come out quoted)."""
    out = dict(m)
    if out.get("content") is None:
        out["content"] = ""
    if "tool_calls" in out:
        out["tool_calls"] = [{**c, "function": {"name": c["function"]["name"],
                                                "arguments": _arguments(c["function"]["arguments"])}}
                             for c in out["tool_calls"]]
    return out


def _arguments(text: str) -> Any:
    """Arguments as an object where they parse as one, else the string as sent."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def fallback_messages(messages: Sequence[Mapping[str, Any]], render: ChatRender) -> list[dict[str, Any]]:
    """The chat rewritten for a template without tool support (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    after_tool = False  # the last message written holds tool results: the next result joins it
    for m in messages:
        if m["role"] == "tool":
            if after_tool:
                out[-1]["content"] += "\n" + tool_response(m)
            else:
                out.append({"role": "user", "content": tool_response(m)})
            after_tool = True
            continue
        after_tool = False
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = calls_text(render.tool_format, m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m["role"], "content": content})
    return _with_preamble(out, render)


def _with_preamble(messages: list[dict[str, Any]], render: ChatRender) -> list[dict[str, Any]]:
    if not render.tools:
        return messages
    text = tools_preamble(render.tools, render.tool_format)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def tool_response(m: Mapping[str, Any]) -> str:
    """One tool result as the fallback shows it to the model."""
    head = " ".join(f"{k}={json.dumps(m[k])}" for k in ("name", "tool_call_id") if m.get(k))
    return f"<tool_response{' ' + head if head else ''}>\n{m.get('content') or ''}\n</tool_response>"


def _call_object(call: Mapping[str, Any], arguments_key: str) -> dict[str, Any]:
    fn = call["function"]
    return {"name": fn["name"], arguments_key: _arguments(fn["arguments"])}


def calls_text(tool_format: str, calls: Sequence[Mapping[str, Any]]) -> str:
    """Tool calls written as a model of this format writes them (what its parser reads back)."""
    if tool_format == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps(_call_object(c, 'arguments'), ensure_ascii=False)}\n</tool_call>"
                         for c in calls)
    if tool_format == "llama3_json":
        return "; ".join(json.dumps(_call_object(c, "parameters"), ensure_ascii=False) for c in calls)
    return "[TOOL_CALLS]" + json.dumps([_call_object(c, "arguments") for c in calls], ensure_ascii=False)


CALL_FORMATS = {
    "hermes": ("put each call in its own <tool_call></tool_call> block holding one JSON object:\n<tool_call>\n"
               "{\"name\": \"<function name>\", \"arguments\": {<arguments>}}\n</tool_call>"),
    "llama3_json": ("answer with only a JSON object {\"name\": \"<function name>\", \"parameters\": "
                    "{<arguments>}}; separate several calls with \"; \""),
    "mistral": ("answer with [TOOL_CALLS] followed by a JSON list of calls: [TOOL_CALLS][{\"name\": "
                "\"<function name>\", \"arguments\": {<arguments>}}]"),
}


def tools_preamble(tools: Sequence[Mapping[str, Any]], tool_format: str) -> str:
    """The system text that tells a model without a tool-aware template which functions it may call, and how."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to help answer. Each function is described by a JSON schema:\n"
            f"{listed}\nTo call functions, {CALL_FORMATS[tool_format]}\nCall only the functions listed, with "
            "arguments that match their parameters. Results come back in <tool_response></tool_response> blocks.")

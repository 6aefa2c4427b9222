"""A chat request's tools and reasoning fields: `tools`, `tool_choice`, `parallel_tool_calls`,
`chat_template_kwargs`, `include_reasoning`, `separate_reasoning` (docs/structured-outputs.md, "Tool calls"
and "Reasoning"), checked once into a `ChatPlan`, and what the plan asks of the engine.

tool_choice "required" and a named function constrain the output with a grammar of the tools' parameter
schemas (tool_grammar.py) in the server's tool-call format, so the arguments always parse; "auto" generates
freely and the answer is parsed (tool_parsers.py); "none" renders the tools and never parses. A reasoning
parser holds any guide back until its end tag ("</think>"): the grammar applies to the answer, not to
the reasoning.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from trtprompt.engine.request import SamplingParams
from trtprompt.error_codes import FieldError
from trtprompt.prompt.chat_tools import DEFAULT_TOOL_FORMAT, RESERVED_TEMPLATE_NAMES, ChatRender, tool_fields
from trtprompt.serve.openai.answer_params import flag, shown
from trtprompt.serve.openai.errors import bad_request
from trtprompt.serve.openai.parser_options import ServedParsers
from trtprompt.serve.openai.reasoning import end_tag
from trtprompt.serve.openai.tool_grammar import tool_call_grammar

TOOL_CHOICES = ("none", "auto", "required")
NAMED = "function"  # ChatPlan.tool_choice of {"type": "function", "function": {"name": ...}}
MAX_TOOLS = 128  # OpenAI's bound on `tools`
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
# The fields of this module, by where they come from (params.CHAT_FIELDS takes them).
FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "include_reasoning",
          "separate_reasoning")


@dataclass(frozen=True)
class ChatPlan:
    """One chat request's tools and reasoning, checked."""

    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "none"  # one of TOOL_CHOICES, or NAMED
    tool_name: str | None = None  # the function tool_choice names
    parallel: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    include_reasoning: bool = True
    separate_reasoning: bool = True
    tool_parser: str | None = None  # the server's; None: never parsed
    reasoning_parser: str | None = None  # the server's; None (or separate_reasoning false): never split

    def __post_init__(self) -> None:
        if self.tool_choice not in (*TOOL_CHOICES, NAMED):
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or {NAMED!r}, "
                             f"got {self.tool_choice!r}")
        if (self.tool_name is not None) != (self.tool_choice == NAMED):
            raise ValueError("tool_name is set exactly when tool_choice names a function")
        if self.tool_choice in ("required", NAMED) and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools")

    @property
    def forces_call(self) -> bool:
        """Whether a grammar holds the answer to tool calls (tool_choice "required" or a named function)."""
        return self.tool_choice in ("required", NAMED)

    @property
    def parses_tools(self) -> bool:
        """Whether the answer is read for tool calls (tool_choice other than none)."""
        return self.tool_choice != "none" and self.tool_parser is not None

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output must be detokenized with special tokens kept: the markers of these families'
        calls (`<|python_tag|>`, `[TOOL_CALLS]`) are special tokens in their vocabularies."""
        return self.parses_tools and self.tool_parser in ("llama3_json", "mistral")

    @property
    def splits_reasoning(self) -> bool:
        return self.reasoning_parser is not None and self.separate_reasoning

    @property
    def render(self) -> ChatRender:
        return ChatRender(self.tools, self.template_kwargs, self.tool_parser or DEFAULT_TOOL_FORMAT)

    @property
    def changes_answer(self) -> bool:
        """Whether the answer is assembled from parsed output (not the text as generated)."""
        return self.parses_tools or self.splits_reasoning

    @property
    def guide_field(self) -> str | None:
        """The client's field a tool-call grammar comes from (the engine's errors about it name this)."""
        return "tools" if self.tool_choice in ("required", NAMED) and self.tool_parser is not None else None

    def without_reasoning(self) -> "ChatPlan":
        """The plan for a prompt that already closed the reasoning (nothing to split)."""
        return dataclasses.replace(self, reasoning_parser=None)


def parse_chat_plan(body: Mapping[str, Any], parsers: ServedParsers) -> ChatPlan:
    """The chat body's tool and reasoning fields as a ChatPlan; 400 naming the field that is wrong."""
    tools = _tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    if choice != "none" and parsers.tool_call is None:
        raise bad_request(f"tool_choice={shown(body.get('tool_choice', 'auto'))} is not supported: this server "
                          "parses no tool calls (started with --tool-call-parser none); send tool_choice \"none\"",
                          "tool_choice", "unsupported_parameter")
    return ChatPlan(tools, choice, name, flag(body, "parallel_tool_calls", True), _template_kwargs(body),
                    flag(body, "include_reasoning", True), flag(body, "separate_reasoning", True),
                    parsers.tool_call, parsers.reasoning)


def message_fields(m: Mapping[str, Any], role: str, where: str) -> dict[str, Any]:
    """A chat message's tool fields (an assistant's tool_calls, a tool result's tool_call_id, name), checked;
    400 naming the message's field."""
    try:
        return tool_fields(m, role, where)
    except ValueError as exc:
        text = str(exc)
        param = text.split(" ", 1)[0]  # tool_fields names the field first: messages[i].tool_calls[j].id
        raise bad_request(text, param) from None


def _tools(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad_request(f"tools must be a list of function tools, got {shown(raw)}", "tools")
    if len(raw) > MAX_TOOLS:
        raise bad_request(f"tools has {len(raw)} tools, more than the {MAX_TOOLS} a request may carry", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t["function"]["name"] for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise bad_request(f"tools names the function {twice[0]!r} more than once", "tools")
    return tools


def _tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"{where} must be a function tool: {{\"type\": \"function\", \"function\": {{\"name\", "
                          f"\"description\", \"parameters\"}}}}, got {shown(tool)}", "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise bad_request(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {shown(name)}",
                          "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema (an object), got {shown(params)}",
                          "tools")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise bad_request(f"{where}.function.strict must be true or false", "tools")
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def _tool_choice(raw: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    """(choice, the named function or None); OpenAI's defaults: auto with tools, none without."""
    if raw is None:
        return ("auto" if tools else "none"), None
    if isinstance(raw, str) and raw in TOOL_CHOICES:
        if raw == "required" and not tools:
            raise bad_request("tool_choice \"required\" needs tools: the request has none", "tool_choice")
        return (raw if tools else "none"), None  # auto with no tools to call: nothing to parse
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request(f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                          f"\"function\": {{\"name\": ...}}}}, got {shown(raw)}", "tool_choice")
    known = [t["function"]["name"] for t in tools]
    if name not in known:
        listed = ", ".join(known) if known else "none: the request has no tools"
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools ({listed})",
                          "tool_choice")
    return NAMED, name


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    raw = body.get("chat_template_kwargs")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad_request(f"chat_template_kwargs must be an object, got {shown(raw)}", "chat_template_kwargs")
    clash = sorted(set(raw) & set(RESERVED_TEMPLATE_NAMES))
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}: the request's own fields "
                          "(messages, tools) and the tokenizer's special tokens fill them", "chat_template_kwargs")
    return dict(raw)


GUIDE_CONFLICT = ("tools with tool_choice {choice} cannot be combined with response_format or guided_* / "
                  "structured_outputs: the guide would hold the whole answer to its own form, leaving no room for "
                  "the tool calls (or, for required and named choices, two grammars would compete for the same "
                  "output); send tool_choice \"none\" to render the tools without calling them, or leave out the "
                  "guide")


def with_tool_guide(sampling: SamplingParams, plan: ChatPlan) -> SamplingParams:
    """sampling with what the plan asks of the engine: the tool-call grammar of required or named choices,
    and guide_after (the reasoning's end tag) for any guide under a reasoning parser."""
    if plan.tool_choice != "none" and sampling.guide_type is not None:
        choice = shown(plan.tool_name if plan.tool_choice == NAMED else plan.tool_choice)
        raise bad_request(GUIDE_CONFLICT.format(choice=choice), "tool_choice", "unsupported_parameter")
    fields: dict[str, Any] = {}
    if plan.tool_choice in ("required", NAMED) and plan.tool_parser is not None:
        try:
            grammar = tool_call_grammar(plan.tool_parser, plan.tools, plan.tool_name, plan.parallel and
                                        plan.tool_choice == "required")
        except FieldError as exc:  # checked above already; the grammar's own words if it finds more
            raise bad_request(str(exc), exc.field.split("[", 1)[0]) from None
        fields.update(guide_type="lark_grammar", guide=grammar)
    if plan.reasoning_parser is not None and (fields or sampling.guide_type is not None):
        fields["guide_after"] = end_tag(plan.reasoning_parser)
    if not fields:
        return sampling
    try:
        return dataclasses.replace(sampling, **fields)
    except FieldError as exc:  # a grammar past the engine's bound on a guide's size
        raise bad_request(f"the tools' call grammar: {exc.rule}", "tools") from None

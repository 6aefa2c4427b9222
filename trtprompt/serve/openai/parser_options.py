"""The OpenAI front end's --tool-call-parser and --reasoning-parser: their values, their help (`trtprompt
serve` and `python -m trtprompt.serve.openai` show the same), and the parsers they resolve to.

"auto" reads the served checkpoint's chat template: its tool-call family (tool_parsers.parser_for_template;
a template that asks for none gets hermes, the format of the tools fallback prompt, prompt/chat_tools.py)
and its reasoning family (reasoning.parser_for_template; none gets none). Light on purpose: the CLI
imports it for its choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from trtprompt.prompt.chat_tools import DEFAULT_TOOL_FORMAT
from trtprompt.serve.openai import reasoning, tool_parsers
from trtprompt.serve.openai.reasoning import REASONING_PARSERS
from trtprompt.serve.openai.tool_parsers import TOOL_PARSERS

AUTO, NONE = "auto", "none"
TOOL_CALL_PARSER_OPTIONS: tuple[str, ...] = (AUTO, *TOOL_PARSERS, NONE)
REASONING_PARSER_OPTIONS: tuple[str, ...] = (AUTO, *REASONING_PARSERS, NONE)
TOOL_CALL_PARSER_HELP = ("How tool calls are read from a chat answer, and the call format the tools fallback "
                         "prompt asks for (templates without tool support): hermes (<tool_call> JSON blocks), "
                         "llama3_json, mistral ([TOOL_CALLS]); auto: the chat template's family, else hermes; "
                         "none: tools are rendered, never parsed (only tool_choice \"none\" is served).")
REASONING_PARSER_HELP = ("How reasoning is split from a chat answer into reasoning_content: deepseek_r1 or qwen3 "
                         "(<think>...</think>); auto: the chat template's family, else none; none: never split.")


@dataclass(frozen=True)
class ServedParsers:
    """The server's tool-call and reasoning parsers, resolved."""

    tool_call: str | None = None  # None: tool calls are never parsed (only tool_choice "none" is served)
    reasoning: str | None = None  # None: reasoning is never split from the content

    def __post_init__(self) -> None:
        if self.tool_call is not None and self.tool_call not in TOOL_PARSERS:
            raise ValueError(f"tool_call parser must be one of {', '.join(TOOL_PARSERS)} or unset, "
                             f"got {self.tool_call!r}")
        if self.reasoning is not None and self.reasoning not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)} or unset, "
                             f"got {self.reasoning!r}")


def check_options(tool_call: str, reasoning_parser: str) -> None:
    """ValueError naming the option whose value is not one of its choices."""
    for option, value, allowed in (("--tool-call-parser", tool_call, TOOL_CALL_PARSER_OPTIONS),
                                   ("--reasoning-parser", reasoning_parser, REASONING_PARSER_OPTIONS)):
        if value not in allowed:
            raise ValueError(f"{option} must be one of {', '.join(allowed)}, got {value!r}")


def served_parsers(tool_call: str, reasoning_parser: str, chat_template: str | None) -> ServedParsers:
    """The parsers the two options name, "auto" resolved from the chat template."""
    check_options(tool_call, reasoning_parser)
    if tool_call == AUTO:
        tools: str | None = tool_parsers.parser_for_template(chat_template) or DEFAULT_TOOL_FORMAT
    else:
        tools = None if tool_call == NONE else tool_call
    if reasoning_parser == AUTO:
        thinks = reasoning.parser_for_template(chat_template)
    else:
        thinks = None if reasoning_parser == NONE else reasoning_parser
    return ServedParsers(tools, thinks)

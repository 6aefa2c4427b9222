"""A chat choice's answer assembled from the generated text under its ChatPlan (tools.py): the reasoning
split off into `reasoning_content` (reasoning.py), tool calls parsed into `tool_calls` (tool_parsers.py),
and what is left as `content`. Whole for a non-streamed answer (`assembled`), delta by delta for a streamed
one (`ChoiceStream`, one per choice: n > 1 streams each choice through its own parsers).

The field names are vLLM's (`reasoning_content`) and OpenAI's (`tool_calls`, deltas indexed per call);
finish_reason becomes "tool_calls" whenever calls were parsed, even where the engine stopped on its end
token or the grammar's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trtprompt.serve.openai.reasoning import ReasoningStream, split_reasoning
from trtprompt.serve.openai.tool_parsers import ContentDelta, StreamEvent, ToolCallStream, parse_tool_calls
from trtprompt.serve.openai.tools import ChatPlan

TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class Assembled:
    """A whole chat answer's message fields and whether it called tools."""

    content: str | None
    reasoning: str | None
    tool_calls: tuple[dict[str, Any], ...]
    shows_reasoning: bool  # the message carries reasoning_content (a reasoning parser split it)

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.shows_reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        return out

    def finish_reason(self, engine_reason: str) -> str:
        return tool_finish_reason(bool(self.tool_calls), engine_reason)


def tool_finish_reason(called: bool, engine_reason: str) -> str:
    """"tool_calls" when calls were parsed, except for an answer max_tokens cut short: that stays "length", as
    OpenAI reports it (clients such as Instructor raise on it instead of using a truncated answer)."""
    return TOOL_CALLS if called and engine_reason != "length" else engine_reason


def assembled(text: str, plan: ChatPlan) -> Assembled:
    """The message a whole generated text makes under plan."""
    reasoning, content = (split_reasoning(plan.reasoning_parser, text) if plan.splits_reasoning
                          and plan.reasoning_parser is not None else (None, text))
    calls: list[dict[str, Any]] = []
    if plan.parses_tools and plan.tool_parser is not None:
        content, parsed = parse_tool_calls(plan.tool_parser, content or "")
        calls = [c.message() for c in parsed[:None if plan.parallel else 1]]
        if plan.forces_call:  # the grammar allowed calls only: what is left is a call max_tokens cut short
            content = None
    shows = plan.splits_reasoning and plan.include_reasoning
    return Assembled(content, reasoning if shows else None, tuple(calls), shows)


class ChoiceStream:
    """One streamed chat choice: text deltas in, OpenAI `delta` objects out (reasoning_content, content,
    one tool-call delta each, as OpenAI streams them)."""

    def __init__(self, plan: ChatPlan) -> None:
        self._reasoning = ReasoningStream(plan.reasoning_parser) \
            if plan.splits_reasoning and plan.reasoning_parser is not None else None
        self._tools = ToolCallStream(plan.tool_parser) if plan.parses_tools and plan.tool_parser is not None \
            else None
        self._include_reasoning = plan.include_reasoning
        self._forced = plan.forces_call  # content outside calls is a call cut short (assembled says why)
        # parallel_tool_calls false: the first call only (the grammar holds forced choices to one; under
        # "auto" the model may write more, and the answer keeps one, as OpenAI's does)
        self._max_calls = None if plan.parallel else 1

    @property
    def called(self) -> bool:
        """Whether tool calls went out (the closing chunk's finish_reason is then "tool_calls")."""
        return self._tools is not None and bool(self._tools.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return self._content(text, False)
        reasoning, content = self._reasoning.feed(text)
        return self._reasoned(reasoning) + self._content(content, False)

    def finish(self) -> list[dict[str, Any]]:
        """What the parsers still held when the choice ended."""
        deltas: list[dict[str, Any]] = []
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish()
            deltas += self._reasoned(reasoning) + self._content(content, False)
        return deltas + self._content("", True)

    def _reasoned(self, text: str) -> list[dict[str, Any]]:
        return [{"reasoning_content": text}] if text and self._include_reasoning else []

    def _content(self, text: str, last: bool) -> list[dict[str, Any]]:
        if self._tools is None:
            return [{"content": text}] if text else []
        events = (self._tools.feed(text) if text else []) + (self._tools.finish() if last else [])
        return [e.delta() for e in events if self._shown(e)]

    def _shown(self, event: StreamEvent) -> bool:
        if isinstance(event, ContentDelta):
            return not self._forced
        return self._max_calls is None or event.index < self._max_calls

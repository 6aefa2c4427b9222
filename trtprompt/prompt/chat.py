"""Chat requests: parse `messages`, render them with the checkpoint's template, and
fit them into the budget with a sliding window over whole turns.

A turn starts at a user message and runs until the next one (the answers
and tool messages in between belong to it). Leading system messages are
kept always; when the rendered chat is too long, the oldest turns go first,
whole turns at a time, never below the profile's `keep_turns` (and never
the last turn). The window is an alteration of the prompt, so it applies
only under a truncating policy: with `reject` a chat that does not fit is
refused, never altered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from trtprompt.error_codes import ErrorCode
from trtprompt.prompt.budget import PromptBudget, PromptError, PromptTooLongError
from trtprompt.prompt.chat_tools import ChatRender, template_inputs, tool_fields

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

# {"role", "content"}; content is null only on an assistant message with tool_calls; a tool-call message
# adds tool_calls, a tool result tool_call_id and name (chat_tools.tool_fields checks them).
Message = dict[str, Any]


def parse_messages(raw: str | bytes) -> list[Message]:
    """A JSON list of {role, content} objects (with their tool fields: chat_tools.tool_fields); PromptError
    naming what is wrong."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(f"input 'messages' is not valid UTF-8 (byte offset {exc.start})") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise PromptError(f"input 'messages' is not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}") from None
    if not isinstance(data, list) or not data:
        raise PromptError("input 'messages' must be a non-empty JSON list of {\"role\", \"content\"} objects")
    return [_message(m, i) for i, m in enumerate(data)]


def _message(item: Any, i: int) -> Message:
    if not isinstance(item, dict):
        raise PromptError(f"messages[{i}] must be an object with 'role' and 'content', got {type(item).__name__}")
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise PromptError(f"messages[{i}] has unknown role {role!r}; allowed: {', '.join(ROLES)}")
    try:
        extra = tool_fields(item, role, f"messages[{i}]")
    except ValueError as exc:
        raise PromptError(str(exc)) from None
    if not isinstance(content, str) and not (content is None and "tool_calls" in extra):
        raise PromptError(f"messages[{i}] ('{role}') must have a string 'content' (null only beside tool_calls)")
    return {"role": role, "content": content, **extra}


def split_turns(messages: Sequence[Message]) -> tuple[list[Message], list[list[Message]]]:
    """(leading system messages, turns); a turn starts at each user message."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    turns: list[list[Message]] = []
    for m in messages[head:]:
        if m["role"] == "user" or not turns:
            turns.append([])
        turns[-1].append(dict(m))
    return [dict(m) for m in messages[:head]], turns


@dataclass(frozen=True)
class FittedChat:
    ids: list[int]
    dropped_turns: int
    num_turns: int


def fit_chat(messages: Sequence[Message], tokenizer: Any, budget: PromptBudget,
             max_tokens: int | None = None, overflow: str | None = None,
             chat_render: ChatRender | None = None) -> FittedChat:
    """Render and fit a chat; tokenizer is a trtprompt.tokenizer.Tokenizer; chat_render: the request's tools
    and template arguments (chat_tools.ChatRender), which every render of the window takes."""
    policy = budget.policy.effective_overflow(overflow)
    limit = budget.limit(policy, max_tokens)
    system, turns = split_turns(messages)
    if not turns:
        raise PromptError("input 'messages' holds only system messages: at least one user turn is required")

    def render(dropped: int) -> list[int]:
        return encode_messages(tokenizer, [*system, *(m for t in turns[dropped:] for m in t)], chat_render)

    ids = render(0)
    if len(ids) <= limit:
        return FittedChat(ids, 0, len(turns))
    if policy == "reject":
        raise PromptTooLongError(len(ids), limit, budget.max_input_len, budget.reserve(policy, max_tokens))
    if system:
        alone = len(encode_messages(tokenizer, system, chat_render))
        if alone > limit:
            raise PromptError(f"the system message alone is {alone} tokens, more than the maximum input "
                              f"length ({limit}); shorten it", ErrorCode.TOO_LONG)
    keep = min(len(turns), budget.policy.keep_turns or 1)
    most = len(turns) - keep
    dropped, fitted = _fewest_drops(render, limit, most)
    if fitted is None:
        shortest = len(render(most))
        raise PromptError(f"chat of {len(ids)} tokens exceeds the maximum input length ({limit}) even after "
                          f"dropping its {most} oldest turns ({shortest} tokens; keep_turns={keep})",
                          ErrorCode.TOO_LONG)
    return FittedChat(fitted, dropped, len(turns))


def _fewest_drops(render: Any, limit: int, most: int) -> tuple[int, list[int] | None]:
    """Smallest number of oldest turns to drop (1..most) so the chat fits; binary search,
    as each drop only shortens the render."""
    lo, hi, best = 1, most, None
    while lo <= hi:
        mid = (lo + hi) // 2
        ids = render(mid)
        if len(ids) <= limit:
            best, hi = (mid, ids), mid - 1
        else:
            lo = mid + 1
    return best if best is not None else (most, None)


def encode_messages(tokenizer: Any, messages: Sequence[Message], render: ChatRender | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
    """The chat's prompt ids, rendered with its tools and template arguments (chat_tools.template_inputs:
    the fallback for a template without tool support); PromptError when the template refuses it."""
    from jinja2.exceptions import TemplateError

    shown, kwargs = template_inputs(messages, tokenizer.chat_template, render)
    try:
        return tokenizer.encode_chat(shown, add_generation_prompt, **kwargs)
    except TemplateError as exc:
        raise PromptError(f"the chat template refused these messages: {exc}") from None
    except TypeError as exc:  # the template did arithmetic on a value of the wrong type (a template kwarg's)
        raise PromptError(f"the chat template failed on these messages or chat_template_kwargs: {exc}") from None
    except ValueError as exc:  # no chat template
        raise PromptError(f"cannot render 'messages': {exc}") from None

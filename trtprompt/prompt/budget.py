"""Length budget at the edge: what to do with a prompt longer than the engine allows.

The profile's `[prompt]` section picks the policy (`overflow`):

- `reject`: the request fails with the engine's own wording, naming the
  prompt length and the limit;
- `truncate_left`: keep the end of the prompt (a leading BOS stays);
- `truncate_middle`: keep the start and the end, dropping the middle and
  marking the cut with `truncate_separator`.

The limit is the engine's maximum input length; when a reserve for the
output applies, a prompt must also leave `reserve` tokens of the sequence
free: limit = min(max_input_len, max_seq_len - reserve). The reserve is the
profile's `output_reserve` when set; when unset, a truncating policy keeps
room for the request's own `max_tokens` (cutting a prompt only to have the
engine shorten the answer would be a poor trade) while `reject` keeps the
engine's rule exactly (no reserve: the engine shortens the output and says so).

A request may ask for a stricter policy than the profile, never a looser
one. Strictest first: reject, truncate_middle (keeps the head, where
instructions live), truncate_left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from trtprompt.error_codes import ErrorCode, RequestError
from trtprompt.knobs import OVERFLOW_POLICIES

# Strictest first; a request may move left of the profile's policy, never right.
STRICTNESS: tuple[str, ...] = OVERFLOW_POLICIES


class PromptError(RequestError):
    """A prompt the edge refuses; the message is meant for the client (INVALID_ARG)."""


class PromptTooLongError(PromptError):
    code = ErrorCode.TOO_LONG

    def __init__(self, prompt_len: int, limit: int, max_input_len: int, reserve: int) -> None:
        text = f"Prompt length ({prompt_len}) exceeds maximum input length ({limit})"
        if limit != max_input_len:
            text += f" (the engine's {max_input_len}, less {reserve} tokens reserved for the output)"
        super().__init__(text)
        self.prompt_len, self.limit = prompt_len, limit


@dataclass(frozen=True)
class PromptPolicy:
    """The `[prompt]` section of a profile, as an engine dir's trtprompt.json records it."""

    overflow: str = "reject"
    keep_turns: int | None = None
    truncate_separator: str = "\n...\n"
    output_reserve: int | None = None
    require_cache_salt: bool = False

    def __post_init__(self) -> None:
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {self.overflow!r}")
        if self.keep_turns is not None and self.keep_turns < 1:
            raise ValueError(f"keep_turns must be at least 1 (or unset), got {self.keep_turns}")
        if self.output_reserve is not None and self.output_reserve < 0:
            raise ValueError(f"output_reserve must be >= 0 (or unset), got {self.output_reserve}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "PromptPolicy":
        known = {k: data[k] for k in ("overflow", "keep_turns", "truncate_separator", "output_reserve",
                                      "require_cache_salt") if k in data and data[k] is not None}
        return cls(**known)

    def effective_overflow(self, requested: str | None) -> str:
        """The policy for one request: the profile's, or a stricter one the request asks for."""
        if requested is None or requested == "":
            return self.overflow
        if requested not in STRICTNESS:
            raise PromptError(f"input 'overflow' must be one of {', '.join(STRICTNESS)}, got {requested!r}")
        if STRICTNESS.index(requested) > STRICTNESS.index(self.overflow):
            raise PromptError(f"overflow={requested!r} is looser than the server's policy {self.overflow!r}; "
                              f"a request may only ask for a stricter one "
                              f"({', '.join(STRICTNESS[:STRICTNESS.index(self.overflow) + 1])})")
        return requested

    def check_salt(self, cache_salt: str | None) -> None:
        if self.require_cache_salt and not cache_salt:
            raise PromptError("input 'cache_salt' is required: this server isolates tenants "
                              "(require_cache_salt = true)")


@dataclass(frozen=True)
class Fitted:
    """A prompt after the budget: the ids to submit and how many prompt tokens were dropped."""

    ids: list[int]
    prompt_truncated_tokens: int
    policy: str


@dataclass(frozen=True)
class PromptBudget:
    """A policy bound to one engine's limits and tokenizer facts."""

    policy: PromptPolicy
    max_input_len: int
    max_seq_len: int
    separator_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.max_input_len < 1 or self.max_seq_len < 2:
            raise ValueError(f"max_input_len must be >= 1 and max_seq_len >= 2, "
                             f"got {self.max_input_len} and {self.max_seq_len}")

    @classmethod
    def for_engine(cls, policy: PromptPolicy, max_input_len: int, max_seq_len: int,
                   tokenizer: Any) -> "PromptBudget":
        """tokenizer: trtprompt.tokenizer.Tokenizer (encodes the separator, knows BOS)."""
        sep = tuple(tokenizer.encode(policy.truncate_separator, add_special_tokens=False))
        return cls(policy, max_input_len, max_seq_len, sep, tokenizer.bos_token_id)

    def reserve(self, overflow: str, max_tokens: int | None) -> int:
        if self.policy.output_reserve is not None:
            return self.policy.output_reserve
        return 0 if overflow == "reject" else int(max_tokens or 0)

    def limit(self, overflow: str, max_tokens: int | None) -> int:
        """Longest prompt allowed under this policy (at least 1 token)."""
        room = self.max_seq_len - self.reserve(overflow, max_tokens)
        return max(1, min(self.max_input_len, room))

    def fit(self, ids: Sequence[int], max_tokens: int | None = None, overflow: str | None = None) -> Fitted:
        """Apply the (request's or profile's) overflow policy to prompt ids."""
        policy = self.policy.effective_overflow(overflow)
        limit = self.limit(policy, max_tokens)
        ids = list(ids)
        if len(ids) <= limit:
            return Fitted(ids, 0, policy)
        if policy == "reject":
            raise PromptTooLongError(len(ids), limit, self.max_input_len, self.reserve(policy, max_tokens))
        if policy == "truncate_middle" and len(self.separator_ids) + 2 <= limit:
            kept, original = self._middle(ids, limit)
        else:  # no room for head + separator + tail: keeping the end is all that is left
            kept, original = self._left(ids, limit)
        return Fitted(kept, len(ids) - original, policy)

    def _left(self, ids: list[int], limit: int) -> tuple[list[int], int]:
        """(kept ids, how many of them come from the prompt)."""
        # Keep a leading BOS: the model was trained to see it first.
        if self.bos_token_id is not None and ids[0] == self.bos_token_id and limit >= 2:
            return [ids[0], *ids[len(ids) - (limit - 1):]], limit
        return ids[len(ids) - limit:], limit

    def _middle(self, ids: list[int], limit: int) -> tuple[list[int], int]:
        keep = limit - len(self.separator_ids)
        head = keep // 2
        tail = keep - head
        return [*ids[:head], *self.separator_ids, *ids[len(ids) - tail:]], keep


def budget_for_engine(engine: Any, tokenizer: Any) -> PromptBudget:
    """The budget of an LLMEngine loaded from an engine dir (its trtprompt.json policy, its limits)."""
    files = getattr(engine, "files", None)
    policy = PromptPolicy.from_mapping(files.prompt) if files is not None else PromptPolicy()
    return PromptBudget.for_engine(policy, engine.max_input_len, engine.scheduler_config.max_seq_len, tokenizer)

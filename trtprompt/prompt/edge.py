"""The prompt edge of a text model: text or chat `messages` in, budgeted prompt ids out.

Used by the serving layer's `ensemble` model (and usable by any front end):
it renders `messages` with the checkpoint's chat template and applies the
sliding window, or encodes `text_input`, then applies the overflow policy
(the request's `overflow` may only be stricter), and enforces
`require_cache_salt`. Every refusal is a PromptError whose message goes
to the client as INVALID_ARG.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from trtprompt.error_codes import ErrorCode
from trtprompt.prompt.budget import PromptBudget, PromptError, PromptPolicy
from trtprompt.prompt.chat import Message, fit_chat
from trtprompt.prompt.chat_tools import ChatRender
from trtprompt.rules import max_input_len

if TYPE_CHECKING:
    from trtprompt.engine.engine_dir import EngineDir


@dataclass(frozen=True)
class EdgePrompt:
    ids: list[int]
    prompt_truncated_tokens: int = 0
    dropped_turns: int = 0


class PromptEdge:
    """limits() returns (max_input_len, max_seq_len); it is asked once, on first use, because
    a serving model may load before the engine it asks is up."""

    def __init__(self, policy: PromptPolicy, tokenizer: Any, add_special_tokens: bool,
                 limits: Callable[[], tuple[int, int]]) -> None:
        self.policy = policy
        self._tokenizer = tokenizer
        self._add_special_tokens = add_special_tokens
        self._limits = limits
        self._budget: PromptBudget | None = None
        self._lock = threading.Lock()

    def budget(self) -> PromptBudget:
        with self._lock:
            if self._budget is None:
                max_input_len, max_seq_len = self._limits()
                self._budget = PromptBudget.for_engine(self.policy, max_input_len, max_seq_len, self._tokenizer)
            return self._budget

    def prepare(self, text: str | None, messages: Sequence[Message] | None, overflow: str | None,
                cache_salt: str | None, max_tokens: int | None, render: ChatRender | None = None) -> EdgePrompt:
        """messages: the chat as objects, parsed once where the request came in (chat.parse_messages
        for a Triton `messages` input, the OpenAI body's own list); render: its tools and template
        arguments (an OpenAI request's)."""
        self.policy.check_salt(cache_salt)
        budget = self.budget()
        overflow = overflow or None
        if messages is not None:
            if text:
                raise PromptError("give either 'text_input' or 'messages': with 'messages', send "
                                  "'text_input' empty")
            fitted = fit_chat(messages, self._tokenizer, budget, max_tokens, overflow, render)
            return EdgePrompt(fitted.ids, 0, fitted.dropped_turns)
        return self.fit_text(text or "", max_tokens, overflow)

    def fit_text(self, text: str, max_tokens: int | None, overflow: str | None = None,
                 input_name: str = "text_input") -> EdgePrompt:
        """Encode and budget a text prompt (prepare checks the salt requirement before it)."""
        text = self.bound_text(text, overflow, input_name)
        ids = self._tokenizer.encode(text, add_special_tokens=self._add_special_tokens)
        cut = self.budget().fit(ids, max_tokens, overflow)
        return EdgePrompt(cut.ids, cut.prompt_truncated_tokens, 0)

    def text_byte_bound(self) -> int:
        """Most bytes of text that max_input_len tokens can stand for: more cannot fit."""
        return self.budget().max_input_len * self._tokenizer.max_token_bytes

    def bound_text(self, text: str, overflow: str | None, input_name: str) -> str:
        """Refuse (reject) or pre-cut (truncating policies) text that cannot fit, before tokenizing.

        Tokenizing megabytes takes seconds of a core (issue 11). A truncating policy keeps only
        what it could keep anyway: twice the bound from the end (and, for truncate_middle, from
        the start), so the cut inside tokenization never reaches the kept tokens; its
        prompt_truncated_tokens then counts the tokens dropped from that window."""
        raw = text.encode("utf-8")
        bound = self.text_byte_bound()
        if len(raw) <= bound:
            return text
        policy = self.policy.effective_overflow(overflow)
        if policy == "reject":
            raise PromptError(
                f"input '{input_name}' is {len(raw)} bytes, more than the {bound} bytes that "
                f"max_input_len ({self.budget().max_input_len}) tokens can hold (this tokenizer's "
                f"longest token is {self._tokenizer.max_token_bytes} bytes); it was not tokenized",
                ErrorCode.TOO_LONG)
        window = 2 * bound
        tail = raw[-window:].decode("utf-8", errors="ignore")
        if policy == "truncate_left":
            return tail
        return raw[:window].decode("utf-8", errors="ignore") + tail


def engine_dir_limits(engine: str | Path | EngineDir,
                      enable_chunked_context: bool | None = None) -> tuple[int, int]:
    """(max_input_len, max_seq_len) of an engine dir, by TensorRT-LLM's runtime rule: max_seq_len - 1
    with chunked context, else min(max_seq_len - 1, max_num_tokens). For models that cannot ask
    the engine (the GPU target's preprocessing). enable_chunked_context: what the server runs with
    (None: the engine's recorded runtime policy)."""
    from trtprompt.engine.engine_dir import EngineDir, read_engine_dir

    if not isinstance(engine, EngineDir):
        engine = read_engine_dir(engine)
    build = engine.build_config
    seq, num = int(build["max_seq_len"]), int(build["max_num_tokens"])
    chunked = engine.runtime.get("enable_chunked_context") if enable_chunked_context is None \
        else enable_chunked_context
    return max_input_len(seq, num, bool(chunked)), seq

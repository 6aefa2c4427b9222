"""OpenAI response objects and server-sent-event framing.

Streams follow the OpenAI API's conventions: each event is one `data: <json>`
line and a blank line; the stream ends with `data: [DONE]`; with
`stream_options.include_usage` the last event before it carries the usage
and an empty `choices` list, and every other chunk has `"usage": null`.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from trtprompt.serve.openai.answer_params import Shape
from trtprompt.serve.openai.chat_answer import assembled
from trtprompt.serve.openai.logprobs import (
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    text_length,
    vllm_prompt_logprobs,
)
from trtprompt.serve.openai.params import Generation
from trtprompt.serve.openai.to_triton import Piece

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


@dataclass
class Tally:
    """What the pieces of one sequence (one choice, before best_of chooses) added up to."""

    text: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reused_blocks: int | None = None
    logprobs: list[TokenLogprob] | None = None
    cum_logprob: float | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    reason: str | None = None  # the engine's finish reason, where it said one
    offset: int = 0  # completions' text_offset: the lengths of the tokens' texts so far

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        for name, value in (("prompt_tokens", piece.num_input_tokens), ("completion_tokens", piece.num_output_tokens),
                            ("reused_blocks", piece.reused_blocks), ("cum_logprob", piece.cum_logprob),
                            ("prompt_logprobs", piece.prompt_logprobs), ("reason", piece.finish_reason)):
            if value is not None:
                setattr(self, name, value)
        if piece.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(piece.logprobs)
            self.offset += text_length(piece.logprobs)

    def finish_reason(self, max_tokens: int) -> str:
        """The engine's, else 'length' when the request used all of max_tokens, else 'stop' (EOS or a
        stop string)."""
        if self.reason in ("stop", "length"):
            return self.reason
        return "length" if self.completion_tokens is not None and self.completion_tokens >= max_tokens else "stop"

    def usage(self, tokens_per_block: int | None) -> dict[str, Any] | None:
        """None when the ensemble returned no token counts (the upstream layout): unknown, not 0."""
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        prompt, completion = self.prompt_tokens, self.completion_tokens
        cached = (self.reused_blocks or 0) * (tokens_per_block or 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


Grid = list[list[Tally]]  # [prompt][sequence]


def usage(grid: Grid, tokens_per_block: int | None) -> dict[str, Any] | None:
    """The request's usage (OpenAI's rule): each prompt counted once, the completion tokens of every
    choice summed (None when any count is unknown)."""
    each = [_prompt_usage(seqs, tokens_per_block) for seqs in grid]
    if any(u is None for u in each):
        return None
    known = [u for u in each if u is not None]
    total = {k: sum(u[k] for u in known) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in known)
    return total | {"prompt_tokens_details": {"cached_tokens": cached}}


def _prompt_usage(seqs: list[Tally], tokens_per_block: int | None) -> dict[str, Any] | None:
    """One prompt's usage over its sequences; its stats (cached blocks) come with its last sequence's end."""
    each = [t.usage(tokens_per_block) for t in seqs]
    if not each or any(u is None for u in each):
        return None
    known = [u for u in each if u is not None]
    prompt, completion = known[0]["prompt_tokens"], sum(u["completion_tokens"] for u in known)
    cached = max(u["prompt_tokens_details"]["cached_tokens"] for u in known)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chosen(seqs: list[Tally], shape: Shape) -> list[Tally]:
    """best_of: the n sequences with the highest summed log probability, best first (vLLM's order)."""
    if shape.sequences == shape.n:
        return seqs
    ranked = sorted(seqs, key=lambda t: t.cum_logprob if t.cum_logprob is not None else -math.inf, reverse=True)
    return ranked[:shape.n]


@dataclass(frozen=True)
class Envelope:
    """The id/created/model fields every object of one request shares."""

    kind: str
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, obj: str) -> dict[str, Any]:
        prefix = "cmpl-" if self.kind == "completion" else "chatcmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}


def full_response(env: Envelope, gen: Generation, grid: Grid, tokens_per_block: int | None) -> dict[str, Any]:
    """The whole answer: n choices per prompt of the request, choice index = prompt index * n + its rank."""
    obj = "text_completion" if env.kind == "completion" else "chat.completion"
    picked = [chosen(seqs, gen.shape) for seqs in grid]
    choices = [_choice(env, gen, t, p * gen.shape.n + i) for p, seqs in enumerate(picked) for i, t in enumerate(seqs)]
    # Usage over every sequence generated, best_of's dropped ones too (OpenAI bills them); the cached
    # tokens ride on the request's last entry, whichever sequence it belongs to.
    out = env.head(obj) | {"choices": choices, "usage": usage(grid, tokens_per_block)}
    if env.kind == "chat" and gen.shape.prompt_logprobs is not None:  # vLLM puts the chat's on the response
        out["prompt_logprobs"] = _prompt_logprobs(gen, grid[0][0])
    return out


def _choice(env: Envelope, gen: Generation, t: Tally, index: int) -> dict[str, Any]:
    text, reason, lps = "".join(t.text), t.finish_reason(gen.max_tokens), shown_logprobs(env, gen, t.logprobs, 0)
    if env.kind == "chat" and gen.chat is not None and gen.chat.changes_answer:  # reasoning and tool calls parsed
        answer = assembled(text, gen.chat)
        return {"index": index, "message": answer.message(), "logprobs": lps,
                "finish_reason": answer.finish_reason(reason)}
    if env.kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                "finish_reason": reason}
    choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": reason}
    if gen.shape.prompt_logprobs is not None:  # vLLM's extension, on each completion choice
        choice["prompt_logprobs"] = _prompt_logprobs(gen, t)
    return choice


def _prompt_logprobs(gen: Generation, t: Tally) -> list[dict[str, Any] | None] | None:
    k = gen.shape.prompt_logprobs
    return None if t.prompt_logprobs is None or k is None else vllm_prompt_logprobs(t.prompt_logprobs, k)


def shown_logprobs(env: Envelope, gen: Generation, lps: Sequence[TokenLogprob] | None,
                   offset: int) -> dict[str, Any] | None:
    """A choice's (or a chunk's) `logprobs`: null unless the client asked for them."""
    k = gen.shape.logprobs
    if k is None or lps is None:
        return None
    return chat_logprobs(lps, k) if env.kind == "chat" else completion_logprobs(lps, k, offset)


def chunk(env: Envelope, gen: Generation, text: str | None, finish_reason: str | None = None,
          first: bool = False, index: int = 0, logprobs: dict[str, Any] | None = None,
          delta: dict[str, Any] | None = None) -> bytes:
    """One streamed chunk of choice `index` (text None: the closing chunk with only a finish_reason). delta:
    a chat delta's fields as given (chat_answer.ChoiceStream's: reasoning_content, tool_calls), not text."""
    if env.kind == "completion":
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        fields: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta is not None:
            fields |= delta
        elif text is not None:
            fields["content"] = text
        choice = {"index": index, "delta": fields, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    payload = env.head(obj) | {"choices": [choice]}
    if gen.include_usage:
        payload["usage"] = None
    return sse(payload)


def usage_chunk(env: Envelope, grid: Grid, tokens_per_block: int | None) -> bytes:
    obj = "text_completion" if env.kind == "completion" else "chat.completion.chunk"
    return sse(env.head(obj) | {"choices": [], "usage": usage(grid, tokens_per_block)})

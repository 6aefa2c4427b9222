"""OpenAI response objects and server-sent-event framing.

Streams follow the OpenAI API's conventions: each event is one `data: <json>`
line and a blank line; the stream ends with `data: [DONE]`; with
`stream_options.include_usage` the last event before it carries the usage
and an empty `choices` list, and every other chunk has `"usage": null`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from trtprompt.serve.openai.params import Generation
from trtprompt.serve.openai.to_triton import Piece

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


@dataclass
class Tally:
    """What the pieces of one request added up to."""

    text: list[str] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reused_blocks: int | None = None

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        for name, value in (("prompt_tokens", piece.num_input_tokens),
                            ("completion_tokens", piece.num_output_tokens), ("reused_blocks", piece.reused_blocks)):
            if value is not None:
                setattr(self, name, value)

    def finish_reason(self, max_tokens: int) -> str:
        """'length' when the request used all of max_tokens, else 'stop' (EOS or a stop string)."""
        return "length" if self.completion_tokens is not None and self.completion_tokens >= max_tokens else "stop"

    def usage(self, tokens_per_block: int | None) -> dict[str, Any] | None:
        """None when the ensemble returned no token counts (the upstream layout): unknown, not 0."""
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        prompt, completion = self.prompt_tokens, self.completion_tokens
        cached = (self.reused_blocks or 0) * (tokens_per_block or 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def usage(tallies: list[Tally], tokens_per_block: int | None) -> dict[str, Any] | None:
    """The request's usage: its choices' summed (None when any choice's counts are unknown)."""
    each = [t.usage(tokens_per_block) for t in tallies]
    if any(u is None for u in each):
        return None
    known = [u for u in each if u is not None]
    total = {k: sum(u[k] for u in known) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in known)
    return total | {"prompt_tokens_details": {"cached_tokens": cached}}


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


def full_response(env: Envelope, gen: Generation, tallies: list[Tally], tokens_per_block: int | None
                  ) -> dict[str, Any]:
    """The whole answer: one choice per prompt of the request, in order."""
    obj = "text_completion" if env.kind == "completion" else "chat.completion"
    choices = [_choice(env, "".join(t.text), t.finish_reason(gen.max_tokens), i) for i, t in enumerate(tallies)]
    return env.head(obj) | {"choices": choices, "usage": usage(tallies, tokens_per_block)}


def _choice(env: Envelope, text: str, reason: str, index: int) -> dict[str, Any]:
    if env.kind == "completion":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": reason}


def chunk(env: Envelope, gen: Generation, text: str | None, finish_reason: str | None = None,
          first: bool = False, index: int = 0) -> bytes:
    """One streamed chunk of choice `index` (text None: the closing chunk with only a finish_reason)."""
    if env.kind == "completion":
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    payload = env.head(obj) | {"choices": [choice]}
    if gen.include_usage:
        payload["usage"] = None
    return sse(payload)


def usage_chunk(env: Envelope, tallies: list[Tally], tokens_per_block: int | None) -> bytes:
    obj = "text_completion" if env.kind == "completion" else "chat.completion.chunk"
    return sse(env.head(obj) | {"choices": [], "usage": usage(tallies, tokens_per_block)})

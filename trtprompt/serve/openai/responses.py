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


def full_response(env: Envelope, gen: Generation, tally: Tally, tokens_per_block: int | None) -> dict[str, Any]:
    text, reason = "".join(tally.text), tally.finish_reason(gen.max_tokens)
    if env.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
        obj = "chat.completion"
    return env.head(obj) | {"choices": [choice], "usage": tally.usage(tokens_per_block)}


def chunk(env: Envelope, gen: Generation, text: str | None, finish_reason: str | None = None,
          first: bool = False) -> bytes:
    """One streamed choice chunk (text None: the closing chunk with only a finish_reason)."""
    if env.kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    payload = env.head(obj) | {"choices": [choice]}
    if gen.include_usage:
        payload["usage"] = None
    return sse(payload)


def usage_chunk(env: Envelope, tally: Tally, tokens_per_block: int | None) -> bytes:
    obj = "text_completion" if env.kind == "completion" else "chat.completion.chunk"
    return sse(env.head(obj) | {"choices": [], "usage": tally.usage(tokens_per_block)})

"""The engine socket's frames as types (docs/design.md, "Request path and engine process protocol").

A frame is JSON on the wire; these are the shapes both ends read and write, so mypy checks every
key a stub, the OpenAI front end or the engine process uses. The readers of the per-sequence keys
(`seq`, `logprobs`, ...) are in outputs.py, with their table. A frame read off the socket is cast
to its type once, where it is read (engine_client.py); its values are checked where they are used,
as before, since the peer is another process.

Stdlib only: the Triton stubs import it.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

# Keys a frame may lack are declared in a total=False subclass (NotRequired is Python 3.11+; 3.10 is supported).


class LogitsBlob(TypedDict):
    """rows x cols float32 values, little-endian, base64 (outputs.logits_of reads it)."""

    rows: int
    cols: int
    f32: str


class _Submit(TypedDict):
    op: Literal["submit"]
    id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams' fields that differ from their defaults (requests.sampling_to_wire)
    cache_salt: str | None
    perf: bool


class SubmitFrame(_Submit, total=False):
    retention: dict[str, Any]  # only when the request has one
    lora: str  # its LoRA adapter's name, only when it has one (engine/lora/)


class _Entry(TypedDict):
    id: str
    finished: bool  # set once per request: on its last entry


class StepEntry(_Entry, total=False):
    """One request's share of a step frame: an output, or an error that ends the request."""

    new_token_ids: list[int]
    num_input_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    warning: str | None
    stats: dict[str, Any]
    error: str  # an error entry: the request ends with it
    code: str
    field: str
    seq: int
    seq_finished: bool
    logprobs: list[list[Any]]
    cum_logprob: float | None
    end_logprob: list[Any]
    prompt_logprobs: list[list[Any] | None]
    context_logits: LogitsBlob
    generation_logits: LogitsBlob


class _Step(TypedDict):
    type: Literal["step"]
    outputs: list[StepEntry]


class StepFrame(_Step, total=False):
    t: float  # when the engine made it (time.monotonic()); engine_client.behind reads it

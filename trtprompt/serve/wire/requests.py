"""The one request type of the serving edge, in its text and its token form.

Each interface builds a `TextRequest` (the fused `ensemble`'s tensors, an OpenAI body) or a
`TokenRequest` (the `tensorrt_llm` model's tensors) once, with its `SamplingParams` already
checked against the engine's bounds; `prepare` turns a text request into the token request the
engine process takes (the prompt edge: budget, chat window, salt rule; stop words as token ids).
Nothing goes back through Triton tensors on the way. `to_wire` / `sampling_from_wire` are the
submit frame's two ends (docs/design.md, "Request path and engine process protocol").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from trtprompt.engine.request import RetentionConfig, SamplingParams, TokenRangeRetention
from trtprompt.error_codes import BadRequestError
from trtprompt.prompt.chat import Message
from trtprompt.prompt.chat_tools import ChatRender
from trtprompt.prompt.edge import EdgePrompt, PromptEdge
from trtprompt.serve.wire.frames import SubmitFrame
from trtprompt.tokenizer import Tokenizer

# How the text paths tokenize prompts and detokenize outputs: the fused ensemble's parameters
# (serve/launch/repository.py) and the OpenAI front end's engine path (serve/openai/to_engine.py).
ADD_SPECIAL_TOKENS = True
SKIP_SPECIAL_TOKENS = True


@dataclass(frozen=True)
class Outputs:
    """What the client asked to get back besides the generated text or ids."""

    exclude_input_in_output: bool = True
    return_perf_metrics: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    perf_final_only: bool = False  # perf outputs on the final response only (fused ensemble)
    return_log_probs: bool = False  # cum_log_probs / output_log_probs (the sampling asks the engine for them)

    @property
    def perf_every_step(self) -> bool:
        """Final outputs carry the request's stats anyway: per-step stats only when every response needs them."""
        return self.return_perf_metrics and not self.perf_final_only

    def counts(self, frame: Mapping[str, Any]) -> dict[str, int]:
        """The num_input_tokens / num_output_tokens outputs the request asked for."""
        asked = {"num_input_tokens": self.return_num_input_tokens, "num_output_tokens": self.return_num_output_tokens}
        return {name: int(frame[name]) for name, wanted in asked.items() if wanted}


def check_text_or_messages(text: str, messages: object | None) -> None:
    """text_input may be empty only when `messages` carries the prompt (on every layout)."""
    if not text and messages is None:
        raise BadRequestError("input 'text_input' is empty: at least one character is required", "text_input")


@dataclass(frozen=True)
class TextRequest:
    """A text prompt (or a chat in `messages`) to generate from, checked except for its length."""

    text: str
    sampling: SamplingParams
    stream: bool
    outputs: Outputs = Outputs()
    messages: tuple[Message, ...] | None = None  # the chat as objects (trtprompt.prompt.chat), instead of text
    overflow: str | None = None
    cache_salt: str | None = None
    stop_words: tuple[str, ...] = ()
    retention: RetentionConfig | None = None  # token ranges over the prompt the engine receives
    chat_render: ChatRender | None = None  # the chat's tools and template arguments (OpenAI's)
    lora: str | None = None  # the LoRA adapter to run it with, by name (None: the base model)

    def __post_init__(self) -> None:
        check_text_or_messages(self.text, self.messages)


@dataclass(frozen=True)
class TokenRequest:
    """What the engine process's submit op takes: prompt ids that fit, checked sampling."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool
    outputs: Outputs = Outputs()
    cache_salt: str | None = None
    retention: RetentionConfig | None = None
    lora: str | None = None  # the LoRA adapter to run it with, by name (None: the base model)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise BadRequestError("input 'input_ids' is empty: at least one token id is required", "input_ids")

    def to_wire(self, request_id: str) -> SubmitFrame:
        """The submit frame (JSON); `retention` only when the request has one."""
        frame: SubmitFrame = {"op": "submit", "id": request_id, "prompt_token_ids": list(self.prompt_token_ids),
                                 "params": sampling_to_wire(self.sampling), "cache_salt": self.cache_salt,
                                 "perf": self.outputs.perf_every_step}
        if self.retention is not None:
            frame["retention"] = retention_to_wire(self.retention)
        if self.lora is not None:
            frame["lora"] = self.lora
        return frame


def retention_to_wire(retention: RetentionConfig) -> dict[str, Any]:
    """The submit frame's `retention`: each range as [start, end or null, priority, duration_ms or null]."""
    return {"token_ranges": [[r.token_start, r.token_end, r.priority, r.duration_ms] for r in retention.token_ranges],
            "decode_priority": retention.decode_priority, "decode_duration_ms": retention.decode_duration_ms}


def retention_from_wire(raw: Any) -> RetentionConfig | None:
    """The submit frame's `retention` back into a RetentionConfig (checked again: the frame is the engine
    process's untrusted input); None when the frame has none."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"token_ranges", "decode_priority", "decode_duration_ms"}:
        raise BadRequestError("submit retention must be an object of token_ranges, decode_priority and "
                              "decode_duration_ms", "retention")
    ranges = raw.get("token_ranges") or []
    if not isinstance(ranges, list) or not all(isinstance(r, list) and len(r) == 4 for r in ranges):
        raise BadRequestError("submit retention.token_ranges must be a list of [start, end, priority, duration_ms]",
                              "retention")
    return RetentionConfig(tuple(TokenRangeRetention(*r) for r in ranges), **{
        k: raw[k] for k in ("decode_priority", "decode_duration_ms") if k in raw})


# SamplingParams fields the submit frame carries as lists (JSON has no tuples), by their element form:
# "ids" a list of token ids, "seqs" a list of token-id lists, "pairs" a list of [token id, float].
_LIST_FIELDS = {"extra_end_ids": "ids", "allowed_token_ids": "ids", "stop_token_ids": "seqs", "bad_words": "seqs",
                "logit_bias": "pairs"}


def sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    """Only the fields that differ from their defaults: a plain request's frame stays small."""
    defaults = SamplingParams()
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)
            if getattr(params, f.name) != getattr(defaults, f.name)}


def sampling_from_wire(raw: Mapping[str, Any]) -> SamplingParams:
    """The submit frame's params back into SamplingParams (which checks them once more: a frame
    is the engine process's untrusted input)."""
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise BadRequestError(f"submit params have unknown field(s): {', '.join(unknown)}", "params")
    values = dict(raw)
    for name, form in _LIST_FIELDS.items():
        if values.get(name) is not None:
            values[name] = _tuple_of(values[name], form, name)
    return SamplingParams(**values)


def _tuple_of(raw: Any, form: str, name: str) -> tuple[Any, ...]:
    if not isinstance(raw, list):
        raise BadRequestError(f"submit params.{name} must be a list", name)
    try:
        if form == "ids":
            return tuple(int(t) for t in raw)
        if form == "seqs":
            return tuple(tuple(int(t) for t in s) for s in raw)
        return tuple((int(t), float(b)) for t, b in raw)
    except (TypeError, ValueError):
        raise BadRequestError(f"submit params.{name} is not of the form its field takes", name) from None


@dataclass(frozen=True)
class Prepared:
    """A text request after the prompt edge: the token request and how its prompt was fitted."""

    request: TokenRequest
    prompt: EdgePrompt


def prepare(req: TextRequest, edge: PromptEdge, tokenizer: Tokenizer) -> Prepared:
    """Fit the prompt (budget, chat window, salt rule: trtprompt.prompt.edge.PromptEdge) and turn
    stop words into token ids: what the fused ensemble and the OpenAI front end both submit."""
    prompt = edge.prepare(req.text, req.messages, req.overflow, req.cache_salt, req.sampling.max_tokens,
                          req.chat_render)
    sampling = with_stop_words(req.sampling, req.stop_words, tokenizer)
    token_req = TokenRequest(tuple(prompt.ids), sampling, req.stream, req.outputs, req.cache_salt, req.retention,
                             req.lora)
    return Prepared(token_req, prompt)


def prepare_ids(req: TokenRequest, stop_words: tuple[str, ...], edge: PromptEdge, tokenizer: Tokenizer) -> Prepared:
    """A prompt given as token ids (an OpenAI completion's), fitted by the rules of a text prompt:
    the salt requirement, then the budget (max_input_len, the profile's overflow policy)."""
    edge.policy.check_salt(req.cache_salt)
    cut = edge.budget().fit(list(req.prompt_token_ids), req.sampling.max_tokens, None)
    sampling = with_stop_words(req.sampling, stop_words, tokenizer)
    fitted = dataclasses.replace(req, prompt_token_ids=tuple(cut.ids), sampling=sampling)
    return Prepared(fitted, EdgePrompt(cut.ids, cut.prompt_truncated_tokens, 0))


def with_stop_words(sampling: SamplingParams, words: tuple[str, ...], tokenizer: Tokenizer) -> SamplingParams:
    """sampling with the stop words as token sequences (the engine matches ids)."""
    if not words:
        return sampling
    stops = tuple(tuple(tokenizer.encode(w, add_special_tokens=False)) for w in words)
    return dataclasses.replace(sampling, stop_token_ids=stops)

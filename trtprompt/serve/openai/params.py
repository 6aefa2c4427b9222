"""Parse and check an OpenAI request body into a `Generation`: the sampling parameters built once
(SamplingParams), the prompts (text or token ids, one or a batch) or the chat, and how to answer.

Strict by design: a parameter this server cannot honour (suffix, the legacy functions, ...) is refused with a 400
naming it, and so is a field neither OpenAI's API nor vLLM's or SGLang's
extensions define (extensions.py: those not honoured here are accepted at the
value that asks for this server's behaviour, noted, or refused).
Bounds are OpenAI's documented ones where OpenAI defines the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping, cast

from trtprompt.engine.request import RetentionConfig, SamplingParams
from trtprompt.error_codes import FieldError
from trtprompt.prompt.chat import Message
from trtprompt.serve.openai import extensions
from trtprompt.serve.openai.answer_params import Shape, Vocabulary, flag, parse_shape, parse_vocabulary, shown
from trtprompt.serve.openai.errors import APIError, bad_request
from trtprompt.serve.openai.guided import EXTENSION_FIELDS as GUIDE_FIELDS
from trtprompt.serve.openai.guided import Guide, client_error, parse_guide
from trtprompt.serve.openai.parser_options import ServedParsers
from trtprompt.serve.openai.retention import CacheMark, cache_mark, parse_retention, with_marks
from trtprompt.serve.openai.tools import FIELDS as TOOL_FIELDS
from trtprompt.serve.openai.tools import ChatPlan, parse_chat_plan, with_tool_guide
from trtprompt.serve.openai.tools import message_fields as tool_message_fields

# Parameters with no effect on the output that clients commonly send.
METADATA_FIELDS = ("user", "metadata", "store", "service_tier")
# trtprompt's own extension: false opts the request out of speculative decoding's drafts (docs/speculative-decoding.md).
SPECULATION_FIELDS = ("speculative_decoding",)
# The vLLM/SGLang extensions honoured here, and trtprompt's (docs/openai.md, "Extension fields").
HONOURED_EXTENSIONS = ("top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids",
                       "cache_salt", "skip_special_tokens", "retention", "prompt_logprobs", "allowed_token_ids",
                       "bad_words", "include_stop_str_in_output", "use_beam_search", "length_penalty",
                       "early_stopping", "lora_path") + GUIDE_FIELDS + SPECULATION_FIELDS
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty",
                 "frequency_penalty", "stream", "stream_options", "n", "logprobs", "logit_bias",
                 "best_of") + HONOURED_EXTENSIONS + METADATA_FIELDS
COMPLETION_FIELDS = COMMON_FIELDS + ("prompt", "echo", "suffix", "response_format") + extensions.names("completion")
CHAT_FIELDS = COMMON_FIELDS + ("messages", "max_completion_tokens", "top_logprobs", "functions", "function_call",
                               "response_format") + TOOL_FIELDS + extensions.names("chat")
# Each prompt of a batch is one engine request: a batch past this is refused rather than filling the queue.
MAX_BATCH_PROMPTS = 64
# OpenAI's bounds for the parameters it defines (closed intervals).
BOUNDS: dict[str, tuple[float, float]] = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0),
                                          "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}  # completions: OpenAI's default; both capped by the engine
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


Prompt = str | tuple[int, ...]  # text, or token ids


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model."""

    name: str  # the model id /v1/models reports and answers carry
    max_model_len: int  # the engine's max_seq_len
    vocab_size: int | None = None  # None: token-id prompts are checked by the engine only
    aliases: tuple[str, ...] = ()  # other names a request's `model` may use (the engine directory's)
    parsers: ServedParsers = ServedParsers()  # tool-call and reasoning parsers (tools.py), by serve options

    @property
    def max_output_len(self) -> int:
        return self.max_model_len - 1

    def serves(self, model: str) -> bool:
        return model == self.name or model in self.aliases


@dataclass(frozen=True)
class Generation:
    """One checked request and how to answer it."""

    kind: str  # "completion" | "chat"
    prompts: tuple[Prompt, ...]  # completions: one per choice; chat: none
    messages: tuple[Message, ...] | None  # the chat as objects, checked
    sampling: SamplingParams
    stop: tuple[str, ...]
    cache_salt: str | None
    stream: bool
    include_usage: bool
    skip_special_tokens: bool = True
    notes: tuple[str, ...] = ()  # extension fields accepted that change nothing here (logged)
    # KV retention (retention.py): the body's `retention`, and chat parts' cache_control marks, whose
    # token ranges are measured once the chat is rendered and fitted.
    retention: RetentionConfig | None = None
    cache_marks: tuple[CacheMark, ...] = ()
    # n, best_of, logprobs, echo, prompt_logprobs (answer_params.py); bad_words as text (the engine path
    # encodes them, as it does stop words)
    shape: Shape = Shape()
    bad_words: tuple[str, ...] = ()
    # The client's field the sampling's guide came from (guided.py): the engine's errors about the guide name it.
    guide_field: str | None = None
    # A chat's tools, tool_choice, template kwargs and reasoning fields (tools.py); None for completions.
    chat: ChatPlan | None = None
    lora: str | None = None  # the LoRA adapter it runs with, by name (lora.py; None: the base model)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def inputs(self) -> tuple[Prompt | None, ...]:
        """What each choice is generated from: a prompt, or None for the chat."""
        return self.prompts if self.kind == "completion" else (None,)


def parse_request(kind: str, body: Any, limits: ModelLimits, lora: str | None = None) -> Generation:
    """Generation for a /v1/completions ('completion') or /v1/chat/completions ('chat') body; `lora`: the
    adapter it asked for by `model` or `lora_path`, which the engine knows (lora.request_adapter)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    _check_fields(kind, body)
    _check_model(body, limits, lora)
    _refuse_unsupported(body)
    notes = extensions.check(kind, body)
    prompts, (messages, marks) = (_prompts(body, limits), (None, ())) if kind == "completion" \
        else ((), _messages(body))
    shape, vocabulary = parse_shape(kind, body), parse_vocabulary(body, limits.vocab_size)
    max_tokens = _max_tokens(kind, body, limits, shape)
    stream = flag(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    guide = parse_guide(body)
    sampling = _sampling_params(body, max_tokens, limits, shape, vocabulary, guide)
    notes += _beam_notes(body, shape)
    plan = parse_chat_plan(body, limits.parsers) if kind == "chat" else None  # tools and reasoning: tools.py
    sampling = sampling if plan is None else with_tool_guide(sampling, plan)
    skip_special = flag(body, "skip_special_tokens", True) and not (plan and plan.keeps_special_tokens)
    guide_field = guide.field if guide else plan.guide_field if plan else None
    return Generation(kind, prompts, messages, sampling, _stop(body), _salt(body), stream, _include_usage(options),
                      skip_special, notes, with_marks(parse_retention(body), marks),
                      marks, shape, vocabulary.bad_words, guide_field, plan, lora)


def _check_fields(kind: str, body: Mapping[str, Any]) -> None:
    known = COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise bad_request(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0],
                          "unrecognized_argument")


def _check_model(body: Mapping[str, Any], limits: ModelLimits, lora: str | None = None) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(f"'model' is required: this server serves {limits.name!r}", "model")
    if not limits.serves(model) and model != lora:
        raise APIError(404, f"the model {shown(model)} does not exist; this server serves {limits.name!r}",
                       "invalid_request_error", "model", "model_not_found")


def _unsupported(param: str, value: Any, why: str) -> None:
    raise bad_request(f"{param}={shown(value)} is not supported: {why}", param, "unsupported_parameter")


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """Parameters that would change the answer in a way this server cannot: 400, never ignored."""
    if body.get("suffix"):
        _unsupported("suffix", body["suffix"], "no insertion (fill-in-the-middle) mode")
    # tools and tool_choice: tools.py. The legacy function-calling fields are refused, pointing at those.
    if body.get("functions"):
        _unsupported("functions", "[...]", "send tools (the legacy functions field is not served)")
    if body.get("function_call") not in (None, "none"):
        _unsupported("function_call", body["function_call"], "send tool_choice (the legacy field is not served)")


PROMPT_FORMS = ("'prompt' is required: a non-empty string, a list of token ids, or a batch (a list) of "
                "either")


def _prompts(body: Mapping[str, Any], limits: ModelLimits) -> tuple[Prompt, ...]:
    """A string, a list of token ids, or a batch of either (OpenAI's and vLLM's forms)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_id(prompt[0])):
        return (_one_prompt(prompt, "prompt", limits),)
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(PROMPT_FORMS, "prompt")
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise bad_request(f"'prompt' is a batch of {len(prompt)} prompts, more than the {MAX_BATCH_PROMPTS} one "
                          "request may carry (send several requests)", "prompt")
    return tuple(_one_prompt(p, f"prompt[{i}]", limits) for i, p in enumerate(prompt))


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_prompt(prompt: Any, where: str, limits: ModelLimits) -> Prompt:
    if isinstance(prompt, str) and prompt:
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(PROMPT_FORMS if where == "prompt" else f"{where} must be a non-empty string or a "
                          "non-empty list of token ids", "prompt")
    return _token_ids(prompt, where, "prompt", limits)


def _token_ids(ids: list[Any], where: str, param: str, limits: ModelLimits) -> tuple[int, ...]:
    """ids as a tuple, each an integer inside the vocabulary (400 naming param otherwise)."""
    for i, t in enumerate(ids):
        if not _is_id(t):
            raise bad_request(f"{where}[{i}] must be a token id (an integer), got {shown(t)}", param)
        if t < 0 or (limits.vocab_size is not None and t >= limits.vocab_size):
            bound = f"[0, {limits.vocab_size})" if limits.vocab_size is not None else ">= 0"
            raise bad_request(f"{where}[{i}]: token id {t} is outside the vocabulary {bound}", param)
    return tuple(ids)


def _messages(body: Mapping[str, Any]) -> tuple[tuple[Message, ...], tuple[CacheMark, ...]]:
    """The chat as {role, content} objects (checked here, once), and its parts' cache_control marks."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' is required and must be a non-empty list", "messages")
    messages = [_message(m, i) for i, m in enumerate(raw)]
    marks = tuple(mark for i, m in enumerate(raw) for mark in _marks(m.get("content"), i))
    return tuple(messages), marks


def _marks(content: Any, i: int) -> list[CacheMark]:
    """The cache_control marks of message i's content parts (checked by _content already)."""
    if not isinstance(content, list):
        return []
    return [cache_mark(part["cache_control"], f"messages[{i}].content[{j}].cache_control", i,
                       "".join(p["text"] for p in content[:j + 1]))
            for j, part in enumerate(content) if part.get("cache_control") is not None]


def _message(m: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object with 'role' and 'content'", where)
    raw_role = m.get("role")
    role = CHAT_ROLES.get(raw_role) if isinstance(raw_role, str) else None  # a list is not hashable
    if role is None:
        raise bad_request(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {shown(raw_role)}",
                          f"{where}.role")
    if m.get("function_call"):
        raise bad_request(f"{where}.function_call is not supported: send tool_calls", f"{where}.function_call",
                          "unsupported_parameter")
    extra = tool_message_fields(m, role, where)  # tool_calls, tool_call_id, name (tools.py)
    content = None if m.get("content") is None and "tool_calls" in extra else _content(m.get("content"), where)
    return {"role": role, "content": content, **extra}


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  "are supported", f"{where}.content", "unsupported_parameter")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {shown(value)}", name)
    return value


def _float(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise bad_request(f"{name} must be a number, got {shown(value)}", name)
    if name in BOUNDS:
        low, high = BOUNDS[name]
        if not low <= value <= high:
            raise bad_request(f"{name} must be in [{low:g}, {high:g}], got {value:g}", name)
    return float(value)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _max_tokens(kind: str, body: Mapping[str, Any], limits: ModelLimits, shape: Shape) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = _int(body, name)
    bound = limits.max_output_len
    if value is None:
        return min(DEFAULT_MAX_TOKENS[kind], bound)
    if value == 0 and _scores_prompt(shape):
        return 0  # prompt scoring (lm-evaluation-harness's loglikelihood): nothing generated
    if not 1 <= value <= bound:
        zero = " (0 only with echo or prompt_logprobs)" if value == 0 else ""
        raise bad_request(f"{name} must be in [1, {bound}] (the model's max_model_len {limits.max_model_len} "
                          f"- 1), got {value}{zero}", name)
    return value


def _scores_prompt(shape: Shape) -> bool:
    """max_tokens 0 answers the prompt alone: its echo or its log probabilities."""
    return shape.echo or shape.prompt_logprobs is not None


# SamplingParams fields under their OpenAI names, where those differ (for the engine's own refusals).
OPENAI_NAMES = {"extra_end_ids": "stop_token_ids"}


def _sampling_params(body: Mapping[str, Any], max_tokens: int, limits: ModelLimits, shape: Shape,
                     vocabulary: Vocabulary, guide: Guide | None = None) -> SamplingParams:
    prompt_logprobs = shape.engine_prompt_logprobs
    if max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0  # echo alone with max_tokens 0: the engine's prompt-scoring request, shown as text
    answer: dict[str, Any] = {"n": shape.sequences, "logprobs": shape.engine_logprobs,
                              "prompt_logprobs": prompt_logprobs,
                              # with or without beams: it changes no token, only whether drafts are verified
                              "speculative_decoding": flag(body, "speculative_decoding", True)}
    fields, beams = _sampling(body, max_tokens, limits), _beam_search(body, shape, max_tokens)
    if beams:  # every other field asks nothing here (_beam_search refused those that did)
        fields = {k: v for k, v in fields.items() if k in BEAM_KEPT} | beams
    if guide is not None:  # after the beam fields: the engine refuses a guide with beams, named as sent
        fields |= guide.sampling_fields()
    try:
        return SamplingParams(max_tokens=max_tokens, **fields, **answer, **vocabulary.sampling_fields())
    except FieldError as exc:  # the engine's bounds (seed's among them), where they are tighter than OpenAI's
        error = bad_request(str(exc), OPENAI_NAMES.get(exc.field, exc.field))
        raise client_error(error, guide.field if guide else None) from None


# What beam search does not combine with (engine/request.py BEAM_SEARCH_EXCLUDES, by their OpenAI names),
# and the values of each that ask for nothing (null, false and empty always do): refused by name otherwise.
BEAM_EXCLUDED: dict[str, tuple[float, ...]] = {
    "top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,), "presence_penalty": (0,),
    "frequency_penalty": (0,), "min_tokens": (0,), "stop": (), "logprobs": (), "top_logprobs": (),
    "prompt_logprobs": (), "logit_bias": (), "allowed_token_ids": (), "bad_words": ()}
# Kept from _sampling with beams: the end of a beam (ignore_eos, stop_token_ids) and a seed, which changes nothing.
BEAM_KEPT = ("ignore_eos", "extra_end_ids", "seed")


def _beam_search(body: Mapping[str, Any], shape: Shape, max_tokens: int) -> dict[str, Any]:
    """vLLM's use_beam_search as SamplingParams fields: shape.beam_width beams (one: greedy), temperature
    ignored (0, transformers' do_sample=False), length_penalty and early_stopping; empty without beams or
    with max_tokens 0 (prompt scoring: nothing to search)."""
    length_penalty, early_stopping = _float(body, "length_penalty"), _early_stopping(body)
    if shape.beam_width is None or max_tokens == 0:
        return {}
    for name, neutral in BEAM_EXCLUDED.items():
        value = body.get(name)
        if not _asks_nothing(value, neutral):
            raise bad_request(f"{name}={shown(value)} is not supported with use_beam_search (beam search takes "
                              "no sampling controls yet)", name, "unsupported_parameter")
    return {"temperature": 0.0, "beam_width": shape.beam_width, "early_stopping": early_stopping,
            "length_penalty": 1.0 if length_penalty is None else length_penalty}


def _asks_nothing(value: Any, neutral: tuple[float, ...]) -> bool:
    if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
        return True
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value in neutral


def _early_stopping(body: Mapping[str, Any]) -> bool | Literal["never"]:
    """vLLM's early_stopping: true, false (its default) or "never" (transformers' meanings)."""
    value = body.get("early_stopping")
    if value is None:
        return False
    if value is True or value is False or value == "never":
        return cast(bool | Literal["never"], value)
    raise bad_request(f"early_stopping must be true, false or \"never\", got {shown(value)}", "early_stopping")


def _beam_notes(body: Mapping[str, Any], shape: Shape) -> tuple[str, ...]:
    """length_penalty and early_stopping change nothing without use_beam_search (vLLM accepts them so too)."""
    if shape.beam_width is not None:
        return ()
    asked = {"length_penalty": body.get("length_penalty") not in (None, 1, 1.0),
             "early_stopping": body.get("early_stopping") not in (None, False)}
    return tuple(f"{name}={shown(body[name])} (used by beam search only: use_beam_search)"
                 for name, on in asked.items() if on)


def _sampling(body: Mapping[str, Any], max_tokens: int, limits: ModelLimits) -> dict[str, Any]:
    """Ensemble sampling inputs, following OpenAI's semantics (see docs/openai.md):
    temperature defaults to 1 and samples from the whole distribution, so
    top_p=1 is sent unless top_k/top_p say otherwise; temperature 0 is greedy."""
    out: dict[str, Any] = {}
    temperature = _float(body, "temperature")
    top_p, top_k = _float(body, "top_p"), _int(body, "top_k")
    out["temperature"] = 1.0 if temperature is None else temperature
    if top_k is not None and top_k not in (-1, 0):  # -1 / 0: no top-k (vLLM's convention)
        if top_k < 1:
            raise bad_request(f"top_k must be -1, 0 or a positive integer, got {top_k}", "top_k")
        out["top_k"] = top_k
    if top_p is not None or ("top_k" not in out and out["temperature"] > 0):
        out["top_p"] = 1.0 if top_p is None else top_p
    if (seed := _int(body, "seed")) is not None:
        out["seed"] = seed  # bounded by SamplingParams, the one place the engine's seed range is declared
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        if (value := _float(body, name)) is not None:
            out[name] = value
    out.update(_extensions(body, max_tokens, limits))
    return out


def _extensions(body: Mapping[str, Any], max_tokens: int, limits: ModelLimits) -> dict[str, Any]:
    """vLLM's and SGLang's honoured extensions: repetition_penalty, min_tokens, ignore_eos, stop_token_ids
    (min_p and top_k are read with the other sampling fields)."""
    out: dict[str, Any] = {}
    rep = _float(body, "repetition_penalty")
    if rep is not None:
        if rep <= 0:
            raise bad_request(f"repetition_penalty must be > 0, got {rep:g}", "repetition_penalty")
        out["repetition_penalty"] = rep
    min_tokens = _int(body, "min_tokens")
    if min_tokens is not None:
        if not 0 <= min_tokens <= max_tokens:
            raise bad_request(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}", "min_tokens")
        out["min_tokens"] = min_tokens
    out["ignore_eos"] = flag(body, "ignore_eos", False)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise bad_request(f"stop_token_ids must be a list of token ids, got {shown(stop_ids)}", "stop_token_ids")
        out["extra_end_ids"] = _token_ids(stop_ids, "stop_token_ids", "stop_token_ids", limits)
    return out


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
    return tuple(words)


def _salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("cache_salt must be a non-empty string", "cache_salt")
    return salt


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad_request("stream_options accepts only include_usage", "stream_options")
    if options.get("continuous_usage_stats"):
        _unsupported("stream_options.continuous_usage_stats", True, "usage comes with the last chunk only")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise bad_request("stream_options.include_usage must be true or false", "stream_options")
    return value

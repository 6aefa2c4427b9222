"""The request fields that shape the answer rather than the prompt: `n`, `best_of`, `logprobs` /
`top_logprobs`, `echo`, vLLM's `prompt_logprobs`, and the vocabulary controls (`logit_bias`, vLLM's
`allowed_token_ids` and `bad_words`, `include_stop_str_in_output`).

Bounds are OpenAI's where OpenAI defines the field, vLLM's for its extensions (docs/openai.md).
What the engine is asked (SamplingParams) can exceed what the client asked: `best_of` needs each
sequence's log probability to choose, and `echo` with `max_tokens: 0` needs a prompt-scoring request;
the answer shows only what was asked (`Shape`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from trtprompt.engine.request import MAX_LOGPROBS, MAX_SEQUENCES
from trtprompt.serve.openai.errors import bad_request

LOGIT_BIAS_BOUND = 100.0  # OpenAI: each bias in [-100, 100]


@dataclass(frozen=True)
class Shape:
    """How many choices come back and what each carries."""

    n: int = 1  # choices per prompt
    best_of: int | None = None  # sequences generated per prompt, the n most likely returned (completions)
    logprobs: int | None = None  # top log probabilities per token shown (None: no logprobs in the answer)
    echo: bool = False  # completions: the prompt (and, with logprobs, its tokens) before the output
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' log probabilities, top-k each
    # vLLM's use_beam_search: the beams searched (None: no beam search); the n best come back, best first
    beam_width: int | None = None

    @property
    def sequences(self) -> int:
        """Sequences the engine generates per prompt."""
        return self.best_of or self.n

    @property
    def engine_logprobs(self) -> int | None:
        """best_of chooses by the sequences' summed log probabilities: the engine must compute them."""
        if self.logprobs is None and self.sequences > self.n:
            return 0
        return self.logprobs

    @property
    def engine_prompt_logprobs(self) -> int | None:
        echoed = self.logprobs if self.echo else None
        known = [k for k in (echoed, self.prompt_logprobs) if k is not None]
        return max(known) if known else None


def parse_shape(kind: str, body: Mapping[str, Any]) -> Shape:
    n = _count(body, "n", 1)
    beams = flag(body, "use_beam_search", False)
    best_of = _best_of(kind, body, n, beams)
    logprobs = _chat_logprobs(body) if kind == "chat" else _completion_logprobs(body)
    echo = kind == "completion" and flag(body, "echo", False)
    prompt_logprobs = _top_k(body, "prompt_logprobs")
    if prompt_logprobs is not None and body.get("stream"):
        raise bad_request("prompt_logprobs is not supported with stream: true (the prompt's log probabilities "
                          "come with the whole answer)", "prompt_logprobs", "unsupported_parameter")
    if beams:  # vLLM's rule: best_of beams (older vLLM) or n (newer), the n best returned
        return Shape(n, None, logprobs, echo, prompt_logprobs, max(n, best_of or n))
    return Shape(n, best_of, logprobs, echo, prompt_logprobs)


def _count(body: Mapping[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SEQUENCES:
        raise bad_request(f"{name} must be an integer in [1, {MAX_SEQUENCES}], got {shown(value)}", name)
    return value


def _best_of(kind: str, body: Mapping[str, Any], n: int, beams: bool) -> int | None:
    """best_of: sequences sampled per prompt, the n most likely returned; with use_beam_search, the beam
    width (streamable: beams come whole at the end anyway)."""
    best_of = _count(body, "best_of", n)
    if best_of == n:
        return None
    if kind == "chat":
        raise bad_request(f"best_of={best_of} is not supported on chat completions (OpenAI defines it for "
                          "/v1/completions only)", "best_of", "unsupported_parameter")
    if best_of < n:
        raise bad_request(f"best_of must be >= n ({n}), got {best_of}", "best_of")
    if body.get("stream") and not beams:
        raise bad_request("best_of > n is not supported with stream: true (the best sequences are known only "
                          "at the end)", "best_of", "unsupported_parameter")
    return best_of


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat: `logprobs` true asks for the chosen tokens', `top_logprobs` (0..20) for the most likely too."""
    on = flag(body, "logprobs", False)
    top = _top_k(body, "top_logprobs")
    if top is not None and not on:
        raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    return (top or 0) if on else None


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Completions (OpenAI's legacy form): `logprobs: k` returns the chosen token's and the k most likely."""
    return _top_k(body, "logprobs")


def _top_k(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {shown(value)}", name)
    return value


def flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """body[name] as a bool (default when absent); 400 naming it otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {shown(value)}", name)
    return value


@dataclass(frozen=True)
class Vocabulary:
    """The vocabulary controls, as SamplingParams takes them (bad_words stay text: the engine path
    encodes them with the tokenizer, to_engine.py)."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    include_stop_in_output: bool = False

    def sampling_fields(self) -> dict[str, Any]:
        return {"logit_bias": self.logit_bias, "allowed_token_ids": self.allowed_token_ids,
                "include_stop_in_output": self.include_stop_in_output}


def parse_vocabulary(body: Mapping[str, Any], vocab_size: int | None) -> Vocabulary:
    return Vocabulary(_logit_bias(body, vocab_size), _allowed(body, vocab_size), _bad_words(body),
                      flag(body, "include_stop_str_in_output", False))


def _logit_bias(body: Mapping[str, Any], vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (as a string, JSON keys being strings) to a bias in [-100, 100]."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise bad_request(f"logit_bias must be an object mapping token ids to biases, got {shown(raw)}",
                          "logit_bias")
    pairs = {_bias_id(key, vocab_size): _bias(key, value) for key, value in raw.items()}
    return tuple(sorted(pairs.items()))


def _bias_id(key: str, vocab_size: int | None) -> int:
    try:
        token = int(key)
    except ValueError:
        raise bad_request(f"logit_bias: key {shown(key)} is not a token id", "logit_bias") from None
    _check_id(token, "logit_bias", vocab_size)
    return token


def _bias(key: str, value: Any) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not -LOGIT_BIAS_BOUND <= value <= LOGIT_BIAS_BOUND:
        raise bad_request(f"logit_bias[{key}] must be a number in [-100, 100], got {shown(value)}", "logit_bias")
    return float(value)


def _check_id(token: int, param: str, vocab_size: int | None) -> None:
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise bad_request(f"{param}: token id {token} is outside the vocabulary {bound}", param)


def _allowed(body: Mapping[str, Any], vocab_size: int | None) -> tuple[int, ...] | None:
    raw = body.get("allowed_token_ids")
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:  # vLLM refuses an empty list too: nothing could be generated
        raise bad_request("allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
    for t in raw:
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad_request(f"allowed_token_ids: {shown(t)} is not a token id", "allowed_token_ids")
        _check_id(t, "allowed_token_ids", vocab_size)
    return tuple(sorted(set(raw)))


def _bad_words(body: Mapping[str, Any]) -> tuple[str, ...]:
    raw = body.get("bad_words")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(w, str) and w.strip() for w in raw):
        raise bad_request("bad_words must be a list of non-empty strings", "bad_words")
    return tuple(raw)


def shown(value: Any, limit: int = 200) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def bad_word_ids(words: tuple[str, ...], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """Each word as token sequences the way vLLM encodes them (SamplingParams.update_from_tokenizer):
    the word without its leading spaces, and " " + that word as well where the space-led form has a
    different first token and as many tokens (the word in the middle of a text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        for ids in (plain, spaced) if _also_spaced(plain, spaced) else (plain,):
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def _also_spaced(plain: tuple[int, ...], spaced: tuple[int, ...]) -> bool:
    return bool(plain and spaced) and spaced[0] != plain[0] and len(spaced) == len(plain)

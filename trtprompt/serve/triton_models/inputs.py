"""Turn a Triton request's input tensors into the serving edge's request types.

Pure numpy: the Python-backend models hand in {name: array} (each array
with the batch dimension first) and get one `TextRequest` or `TokenRequest`
(serve/wire/requests.py) per batch row, or a RequestError whose message names
the input and goes to the client.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

from trtprompt.engine.request import FLOAT_BOUNDS, RetentionConfig, SamplingParams
from trtprompt.error_codes import BadRequestError, FieldError, OverBoundError
from trtprompt.interface import PERF_OUTPUTS, SPECULATION_INPUT
from trtprompt.prompt.chat import parse_messages
from trtprompt.serve.triton_models import guided
from trtprompt.serve.triton_models.lora_inputs import lora_input
from trtprompt.serve.wire.requests import Outputs, TextRequest, TokenRequest, check_text_or_messages
from trtprompt.serve.wire.retention_inputs import DECODE_INPUTS, RANGE_INPUTS, retention_from_inputs

Array = np.ndarray[Any, Any]  # a Triton input tensor of any dtype and shape
Tensors = Mapping[str, Array]


def batch_size(tensors: Tensors, required: str, *alternatives: str) -> int:
    """Rows of the request, from its required input (or the first alternative present)."""
    for name in (required, *alternatives):
        if name in tensors:
            return int(tensors[name].shape[0])
    raise BadRequestError(f"input '{required}' is required")


def _row(tensors: Tensors, name: str, i: int) -> Array | None:
    arr = tensors.get(name)
    if arr is None:
        return None
    return arr[i] if arr.shape and arr.shape[0] > i else arr


def scalar(tensors: Tensors, name: str, i: int, cast: Callable[[Any], Any]) -> Any:
    """Value of a [B, 1] input for row i, or None when absent."""
    row = _row(tensors, name, i)
    if row is None:
        return None
    flat = np.asarray(row).reshape(-1)
    if flat.size != 1:
        raise BadRequestError(f"input '{name}' must hold one value per request, got shape {tuple(row.shape)}")
    return cast(flat[0].item() if hasattr(flat[0], "item") else flat[0])


def flag(tensors: Tensors, name: str, i: int, default: bool = False) -> bool:
    value = scalar(tensors, name, i, bool)
    return default if value is None else value


# TensorRT-LLM's raw logits flags; SamplingParams names its fields alike. The engine returns the logits
# (float32, before any processing) and refuses a request whose logits would pass MAX_LOGITS_BYTES, naming
# the flag; it refuses both with beam search.
LOGITS_FLAGS: tuple[str, ...] = ("return_context_logits", "return_generation_logits")


def check_unsupported(tensors: Tensors, i: int) -> None:
    """Inputs the torch target cannot honour: refuse rather than ignore."""
    for name in ("prompt_embedding_table", "prompt_vocab_size"):
        if name in tensors:
            raise BadRequestError(f"'{name}' is not supported by the torch target (no prompt tables)")


def utf8(value: Any, name: str) -> str:
    raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"input '{name}' is not valid UTF-8: byte 0x{raw[exc.start]:02x} "
                              f"at position {exc.start}") from None


def text_scalar(tensors: Tensors, name: str, i: int, label: str | None = None) -> str | None:
    """A [B, 1] string input of row i as text, or None when absent; errors name it `label` (the
    ensemble's name when a composing model's own name differs, e.g. preprocessing's MESSAGES)."""
    value = scalar(tensors, name, i, lambda v: v)
    return None if value is None else utf8(value, label or name)


def words(tensors: Tensors, name: str, i: int) -> list[str]:
    row = _row(tensors, name, i)
    if row is None:
        return []
    return [w for w in (utf8(v, name) for v in np.asarray(row).reshape(-1)) if w]


Extra = Mapping[str, tuple[Any, str]]  # SamplingParams field -> (value, the input that set it)


def _sampling(tensors: Tensors, i: int, names: Mapping[str, tuple[str, ...]], extra: Extra) -> SamplingParams:
    """The row's SamplingParams, built once here; names maps each scalar field to the input names that set
    it, extra holds the fields the caller built from list inputs (stop and bad words, bias, sequences)."""
    casts = {"max_tokens": int, "top_k": int, "min_tokens": int, "seed": int, "end_id": int,
             "temperature": float, "top_p": float, "repetition_penalty": float,
             "presence_penalty": float, "frequency_penalty": float, "length_penalty": float}
    params: dict[str, Any] = {key: value for key, (value, _) in extra.items()}
    used: dict[str, str] = {key: source for key, (_, source) in extra.items()}  # for error messages
    for key, sources in names.items():
        for source in sources:
            value = scalar(tensors, source, i, casts[key])
            if value is not None:
                params[key], used[key] = value, source
                break
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        raise BadRequestError(f"input '{names['max_tokens'][0]}' is required")
    if max_tokens <= 0:
        raise BadRequestError(f"{names['max_tokens'][0]} must be a positive integer, got {max_tokens}")
    return _checked_sampling(params, used)


def _named(exc: FieldError, source: str) -> BadRequestError:
    """The refusal of one field, naming the client's input that set it."""
    if exc.field in FLOAT_BOUNDS:
        return BadRequestError(f"input '{source}' {exc.rule}", source)
    return BadRequestError(f"input '{source}': {exc}", source)


def _checked_sampling(params: Mapping[str, Any], sources: Mapping[str, str]) -> SamplingParams:
    """SamplingParams, its refusal naming the client's input."""
    try:
        return SamplingParams(**params)
    except FieldError as exc:
        raise _named(exc, sources.get(exc.field, exc.field)) from None


TEXT_SAMPLING = {
    "max_tokens": ("max_tokens",), "temperature": ("temperature",), "top_k": ("top_k",),
    "top_p": ("top_p",), "repetition_penalty": ("repetition_penalty",),
    "presence_penalty": ("presence_penalty",), "frequency_penalty": ("frequency_penalty",),
    "min_tokens": ("min_tokens", "min_length"), "seed": ("seed", "random_seed"), "end_id": ("end_id",),
    "length_penalty": ("length_penalty",),
}
TOKEN_SAMPLING = {
    "max_tokens": ("request_output_len",), "temperature": ("temperature",), "top_k": ("runtime_top_k",),
    "top_p": ("runtime_top_p",), "repetition_penalty": ("repetition_penalty",),
    "presence_penalty": ("presence_penalty",), "frequency_penalty": ("frequency_penalty",),
    "min_tokens": ("min_tokens", "min_length"), "seed": ("random_seed", "seed"), "end_id": ("end_id",),
    "length_penalty": ("len_penalty",),
}


def outputs(tensors: Tensors, i: int, exclude_default: bool) -> Outputs:
    """What the row asks to get back (the ensemble's and the core model's flags share names)."""
    return Outputs(
        exclude_input_in_output=flag(tensors, "exclude_input_in_output", i, exclude_default),
        return_perf_metrics=flag(tensors, "return_perf_metrics", i),
        return_num_input_tokens=flag(tensors, "return_num_input_tokens", i),
        return_num_output_tokens=flag(tensors, "return_num_output_tokens", i),
        perf_final_only=flag(tensors, "perf_metrics_final_only", i),
        return_log_probs=flag(tensors, "return_log_probs", i))


Encode = Callable[[str], list[int]]  # a word's token ids, without special tokens


def _no_tokenizer(word: str) -> list[int]:
    """parse_text_item's encode where its caller has no tokenizer: a server bug if ever reached."""
    raise RuntimeError("word inputs need the model's tokenizer: parse_text_item was given no encoder")


def sequence_controls(tensors: Tensors, i: int, max_beam_width: int) -> dict[str, tuple[Any, str]]:
    """SamplingParams fields of the inputs both models share: num_return_sequences (each sequence comes back
    in its own responses, with its sequence_index; with beams, how many of the best come back together),
    return_log_probs (the chosen tokens' only: 0 top), the logits flags and the beam search inputs."""
    extra: dict[str, tuple[Any, str]] = {}
    n = scalar(tensors, "num_return_sequences", i, int)
    if n is not None:
        if n < 1:
            raise BadRequestError(f"input 'num_return_sequences' must be >= 1, got {n}", "num_return_sequences")
        extra["n"] = (n, "num_return_sequences")
    beams = beam_controls(tensors, i, max_beam_width, n)
    # A beam's cum_log_probs comes without asking the engine for per-token values (it gives none with beams).
    if flag(tensors, "return_log_probs", i) and not beams:
        extra["logprobs"] = (0, "return_log_probs")
    extra |= {name: (True, name) for name in LOGITS_FLAGS if flag(tensors, name, i)}
    return extra | beams


def beam_controls(tensors: Tensors, i: int, max_beam_width: int, n: int | None) -> dict[str, tuple[Any, str]]:
    """beam_width (at most the server's max_beam_width, refused naming both as TensorRT-LLM does) and
    early_stopping, TensorRT-LLM's default true when absent; empty without beams. The beams returned:
    num_return_sequences of them, else all beam_width (TensorRT-LLM's default)."""
    width = scalar(tensors, "beam_width", i, int)
    if width is None or width == 1:
        return {}
    if width < 1:
        raise BadRequestError(f"input 'beam_width' must be >= 1, got {width}", "beam_width")
    if width > max_beam_width:
        raise BadRequestError(f"input 'beam_width' ({width}) exceeds max_beam_width ({max_beam_width}), this "
                              "server's bound (trtprompt serve --max-beam-width)", "beam_width")
    if n is not None and n > width:
        raise BadRequestError(f"input 'num_return_sequences' ({n}) must be at most beam_width ({width}): the "
                              "beams returned", "num_return_sequences")
    early = flag(tensors, "early_stopping", i, True)
    return {"beam_width": (width, "beam_width"), "early_stopping": (early, "early_stopping"),
            "n": (width if n is None else n, "num_return_sequences")}


def guide_controls(tensors: Tensors, i: int) -> dict[str, tuple[Any, str]]:
    """SamplingParams.guide_type / guide from guided_decoding_guide_type / guided_decoding_guide (guided.py);
    empty without a guide."""
    kind, text = (text_scalar(tensors, name, i) for name in (guided.GUIDE_TYPE_INPUT, guided.GUIDE_INPUT))
    return guided.guide_fields(guided.guide_of(kind, text))


def speculation_controls(tensors: Tensors, i: int) -> dict[str, tuple[Any, str]]:
    """SamplingParams.speculative_decoding from the speculative_decoding input (interface.SPECULATION_INPUT):
    false opts this request out of drafts; empty when absent or true (the field's default)."""
    if flag(tensors, SPECULATION_INPUT, i, True):
        return {}
    return {"speculative_decoding": (False, SPECULATION_INPUT)}


def request_controls(tensors: Tensors, i: int, max_beam_width: int) -> dict[str, tuple[Any, str]]:
    """The SamplingParams fields both models read alike: sequences and beams, the guide, the speculation opt-out."""
    return sequence_controls(tensors, i, max_beam_width) | guide_controls(tensors, i) | speculation_controls(tensors, i)


def word_ids(tensors: Tensors, name: str, i: int, encode: Encode) -> tuple[tuple[int, ...], ...]:
    """A words input as token sequences, each word tokenized alone without special tokens (tensorrtllm_backend's
    preprocessing, as for stop_words); a word of no tokens is dropped, as there."""
    return tuple(ids for ids in (tuple(encode(w)) for w in words(tensors, name, i)) if ids)


def _bias_pairs(bias: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
    """SamplingParams.logit_bias: sorted by id, zero biases left out."""
    return tuple(sorted((t, b) for t, b in bias.items() if b != 0.0))


def _finite(values: list[float], name: str) -> list[float]:
    bad = next((v for v in values if not math.isfinite(v)), None)
    if bad is not None:
        raise BadRequestError(f"input '{name}' must hold finite numbers, got {bad!r}", name)
    return values


BIAS_WORDS, BIAS_WEIGHTS = "embedding_bias_words", "embedding_bias_weights"


def bias_from_words(tensors: Tensors, i: int, encode: Encode) -> tuple[tuple[int, float], ...]:
    """embedding_bias_words / embedding_bias_weights as a logit bias: as tensorrtllm_backend's preprocessing
    builds its vocab-sized bias, every token of a word gets the word's weight, summed where words share a
    token. Unlike it, words are tokenized without special tokens (it would also bias the BOS token)."""
    raw_words, raw_weights = _row(tensors, BIAS_WORDS, i), _row(tensors, BIAS_WEIGHTS, i)
    texts = [] if raw_words is None else [utf8(v, BIAS_WORDS) for v in np.asarray(raw_words).reshape(-1)]
    weights = [] if raw_weights is None else [float(v) for v in np.asarray(raw_weights).reshape(-1)]
    if len(texts) != len(weights):
        raise BadRequestError(f"inputs '{BIAS_WORDS}' ({len(texts)} words) and '{BIAS_WEIGHTS}' ({len(weights)} "
                              "weights) must have the same length: one weight per word", BIAS_WORDS)
    bias: dict[int, float] = {}
    for word, weight in zip(texts, _finite(weights, BIAS_WEIGHTS)):
        for token in encode(word):
            bias[token] = bias.get(token, 0.0) + weight
    return _bias_pairs(bias)


def bias_from_vector(tensors: Tensors, i: int, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """The token model's embedding_bias (one FP32 per vocabulary entry, TensorRT-LLM's) as a logit bias;
    empty: none."""
    row = _row(tensors, "embedding_bias", i)
    if row is None or np.asarray(row).size == 0:
        return ()
    vector = _finite([float(v) for v in np.asarray(row).reshape(-1)], "embedding_bias")
    if vocab_size is not None and len(vector) != vocab_size:
        raise BadRequestError(f"input 'embedding_bias' must hold one bias per vocabulary entry ({vocab_size}), "
                              f"got {len(vector)}", "embedding_bias")
    return _bias_pairs(dict(enumerate(vector)))


def _vector(tensors: Tensors, name: str, i: int) -> list[int] | None:
    row = _row(tensors, name, i)
    return None if row is None else [int(v) for v in np.asarray(row).reshape(-1)]


def retention(tensors: Tensors, i: int) -> RetentionConfig | None:
    """The row's RetentionConfig from TensorRT-LLM's six retention inputs (serve/wire/retention_inputs.py
    checks them), None when none is given; a refusal names the input."""
    vectors = {name: _vector(tensors, name, i) for name in RANGE_INPUTS}
    decode = {name: scalar(tensors, name, i, int) for name in DECODE_INPUTS}
    return retention_from_inputs(vectors, decode)


def parse_text_item(tensors: Tensors, i: int, exclude_default: bool, encode: Encode = _no_tokenizer,
                    max_beam_width: int = 1) -> TextRequest:
    """One row of an `ensemble` request (text in, text out); encode tokenizes bad_words and
    embedding_bias_words (stop_words are tokenized later, by prepare)."""
    check_unsupported(tensors, i)
    text = utf8(scalar(tensors, "text_input", i, lambda v: v), "text_input")
    raw_messages, overflow, salt = (text_scalar(tensors, name, i) for name in ("messages", "overflow", "cache_salt"))
    check_text_or_messages(text, raw_messages)
    messages = None if raw_messages is None else tuple(parse_messages(raw_messages))  # parsed once, here
    extra = request_controls(tensors, i, max_beam_width)
    if words(tensors, "bad_words", i):
        extra["bad_words"] = (word_ids(tensors, "bad_words", i, encode), "bad_words")
    if BIAS_WORDS in tensors or BIAS_WEIGHTS in tensors:
        extra["logit_bias"] = (bias_from_words(tensors, i, encode), BIAS_WORDS)
    stop_words = tuple(words(tensors, "stop_words", i))
    if stop_words and "beam_width" in extra:  # named here: prepare turns them into the engine's stop sequences
        raise BadRequestError("input 'stop_words' is not supported with beam search (beam_width > 1) yet",
                              "stop_words")
    return TextRequest(text=text, sampling=_sampling(tensors, i, TEXT_SAMPLING, extra),
                       stream=flag(tensors, "stream", i), outputs=outputs(tensors, i, exclude_default),
                       messages=messages, overflow=overflow, cache_salt=salt,
                       stop_words=stop_words, retention=retention(tensors, i), lora=lora_name(tensors, i))


def words_list(arr: Array | None, name: str) -> list[list[int]]:
    """TensorRT-LLM's [2, L] words list: row 0 the ids, row 1 the end offsets (-1 padded)."""
    if arr is None or arr.size == 0:
        return []
    if arr.ndim != 2 or arr.shape[0] != 2:
        raise BadRequestError(f"input '{name}' must have shape [2, L] per request, got {tuple(arr.shape)}")
    ids, offsets = arr[0].tolist(), [int(o) for o in arr[1] if o >= 0]
    out, start = [], 0
    for end in offsets:
        if not start < end <= len(ids):
            raise BadRequestError(f"input '{name}' has an offset {end} outside its {len(ids)} ids")
        out.append([int(t) for t in ids[start:end]])
        start = end
    return out


def prompt_ids(tensors: Tensors, i: int, max_input_len: int | None) -> Array:
    """input_ids[:input_lengths] of row i, refused here (before anything reaches the engine) when
    empty or longer than the engine's max_input_len."""
    ids = _row(tensors, "input_ids", i)
    if ids is None:
        raise BadRequestError("input 'input_ids' is required")
    ids = np.asarray(ids).reshape(-1)
    if ids.size == 0:
        raise BadRequestError("input 'input_ids' is empty: at least one token id is required")
    length = scalar(tensors, "input_lengths", i, int)
    if length is None:
        raise BadRequestError("input 'input_lengths' is required")
    if not 0 < length <= ids.size:
        raise BadRequestError(f"input_lengths ({length}) must be in [1, {ids.size}] (the input_ids length)")
    if max_input_len is not None and length > max_input_len:
        raise OverBoundError(f"input 'input_ids': Prompt length ({length}) exceeds maximum input length "
                             f"({max_input_len}, the engine's max_input_len)")
    return ids[:length]


def parse_token_item(tensors: Tensors, i: int, exclude_default: bool, max_input_len: int | None = None,
                     vocab_size: int | None = None, max_beam_width: int = 1) -> TokenRequest:
    """One row of a `tensorrt_llm` request (token ids in, token ids out); vocab_size checks embedding_bias."""
    check_unsupported(tensors, i)
    ids = prompt_ids(tensors, i, max_input_len)
    extra = request_controls(tensors, i, max_beam_width)
    for name, field in (("stop_words_list", "stop_token_ids"), ("bad_words_list", "bad_words")):
        extra[field] = (tuple(tuple(w) for w in words_list(_row(tensors, name, i), name)), name)
    extra["logit_bias"] = (bias_from_vector(tensors, i, vocab_size), "embedding_bias")
    return TokenRequest(prompt_token_ids=tuple(ids.astype(np.int64).tolist()),
                        sampling=_sampling(tensors, i, TOKEN_SAMPLING, extra), stream=flag(tensors, "streaming", i),
                        outputs=outputs(tensors, i, exclude_default), cache_salt=text_scalar(tensors, "cache_salt", i),
                        retention=retention(tensors, i), lora=lora_name(tensors, i))


def lora_name(tensors: Tensors, i: int) -> str | None:
    """The engine adapter row i runs with: its lora_task_id's (lora_inputs.py), None for the base model."""
    lora = lora_input(tensors, i)
    return None if lora is None else lora.name


def perf_values(stats: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """The return_perf_metrics outputs (name -> (value, numpy dtype)) from an output frame's
    request stats, whose keys are the outputs' names; a time not reached yet is 0."""
    return {name: (float(stats.get(name) or 0), "float32") if dtype == "FP32" else
            (int(stats.get(name) or 0), dtype.lower()) for name, dtype, *_ in PERF_OUTPUTS}

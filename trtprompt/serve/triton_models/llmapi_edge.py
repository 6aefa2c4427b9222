"""The prompt edge in front of TensorRT-LLM's llmapi `tensorrt_llm` model (1.3+), as plain functions.

The `ensemble` model of an llmapi repository (models/llmapi_ensemble.py) is a
decoupled Python model that takes the same client inputs as every other
layout (`text_input`, `max_tokens`, `stream`, `stop_words`, `messages`,
`overflow`, `cache_salt`, sampling inputs; `text_output` back), runs this
project's prompt edge on them (the same bounds checks and error wording as
the fused ensemble and preprocessing: trtprompt.prompt.edge), and calls the
llmapi model through BLS with that model's own input names
(`sampling_param_*`, `streaming`). The llmapi model takes text, not token
ids, so a prompt the edge had to cut (or a chat it rendered) is handed on as
the text of the ids it kept; an untouched prompt is handed on unchanged.

Everything here is numpy and the standard library, so it is tested without
Triton (tests/test_llmapi_repository.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from trtprompt.error_codes import BadRequestError
from trtprompt.interface import RETENTION_INPUTS
from trtprompt.serve.triton_models import inputs
from trtprompt.serve.triton_models.inputs import Array
from trtprompt.serve.wire.requests import check_text_or_messages

# client input -> (llmapi model input, numpy dtype); each [1] per request.
SAMPLING: dict[str, tuple[str, str]] = {
    "temperature": ("sampling_param_temperature", "float32"),
    "top_k": ("sampling_param_top_k", "int32"),
    "top_p": ("sampling_param_top_p", "float32"),
    "presence_penalty": ("sampling_param_presence_penalty", "float32"),
    "frequency_penalty": ("sampling_param_frequency_penalty", "float32"),
    "seed": ("sampling_param_seed", "uint64"),
    "exclude_input_in_output": ("sampling_param_exclude_input_from_output", "bool"),
    "return_perf_metrics": ("sampling_param_return_perf_metrics", "bool"),
    # Not a SamplingParams field there: the model's output switch for CompletionOutput.cumulative_logprob.
    "return_log_probs": ("return_cumulative_logprob", "bool"),
}
# llmapi model output -> the ensemble output every other layout names it with.
OUTPUT_NAMES: dict[str, str] = {
    "text_output": "text_output",
    "kv_cache_reused_block": "kv_cache_reused_blocks",
    "kv_cache_alloc_new_blocks": "kv_cache_alloc_new_blocks",
    "kv_cache_alloc_total_blocks": "kv_cache_alloc_total_blocks",
    "arrival_time_ns": "arrival_time_ns",
    "first_scheduled_time_ns": "first_scheduled_time_ns",
    "first_token_time_ns": "first_token_time_ns",
    "last_token_time_ns": "last_token_time_ns",
    "cumulative_logprob": "cum_log_probs",  # one per CompletionOutput; model.py writes each as its str()
}
# Client inputs TensorRT-LLM's llmapi Triton model cannot carry: its model.py builds SamplingParams from
# best_of, temperature, top_k, top_p, the penalties, max_tokens, seed, stop and two flags only, so n,
# use_beam_search, bad, embedding_bias and the logits switches never reach the LLM API. Each is refused
# when it asks for more than the default (docs/gpu.md, "What each TensorRT-LLM target carries").
UNCARRIED: dict[str, str] = {
    "num_return_sequences": "n", "beam_width": "use_beam_search", "bad_words": "bad",
    "embedding_bias_words": "embedding_bias", "embedding_bias_weights": "embedding_bias",
    "return_context_logits": "return_context_logits", "return_generation_logits": "return_generation_logits",
    "guided_decoding_guide_type": "guided_decoding", "guided_decoding_guide": "guided_decoding",
}
UNCARRIED_REFUSAL = ("input '{name}' cannot be honoured: TensorRT-LLM's llmapi Triton model passes no SamplingParams "
                     "'{field}' to the LLM API; serve with the trtllm (1.2 engine) or torch target to use it")
SALT_REFUSAL = ("input 'cache_salt' cannot be honoured: TensorRT-LLM's llmapi Triton model has no per-request "
                "cache salt input, so KV blocks could not be kept apart")
# The LLM API takes retention as generate_async(kv_cache_retention_config=KvCacheRetentionConfig(...)), but
# TensorRT-LLM's llmapi Triton model (its model.py, which this layout calls) passes none and declares no such
# input: refused rather than dropped (docs/prefix-pool.md, "TensorRT-LLM targets").
RETENTION_NAMES: tuple[str, ...] = tuple(name for name, *_ in RETENTION_INPUTS)
RETENTION_REFUSAL = ("input '{name}' cannot be honoured: TensorRT-LLM's llmapi Triton model passes no "
                     "KvCacheRetentionConfig to the LLM API, so retention priorities would be ignored; serve with "
                     "the trtllm (1.2 engine) or torch target to use them")


@dataclass(frozen=True)
class EdgeResult:
    """What the llmapi model is asked for one request."""

    text: str
    max_tokens: int
    stream: bool
    stop: tuple[str, ...]
    sampling: Mapping[str, tuple[Any, str]]  # llmapi input name -> (value, numpy dtype)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


def _max_tokens(tensors: Mapping[str, Array]) -> int:
    value = inputs.scalar(tensors, "max_tokens", 0, int)
    if value is None:
        raise BadRequestError("input 'max_tokens' is required", "max_tokens")
    if value < 1:
        raise BadRequestError(f"input 'max_tokens' must be >= 1, got {value}", "max_tokens")
    return int(value)


def _sampling(tensors: Mapping[str, Array]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for name, (target, dtype) in SAMPLING.items():
        value = inputs.scalar(tensors, name, 0, lambda v: v)
        if value is not None:
            out[target] = (value, dtype)
    return out


def _asks_more_than_default(tensors: Mapping[str, Array], name: str) -> bool:
    """True when an uncarried input would change the result: a count or width above 1, a true flag, or
    any word or weight (a default value is accepted, as the other layouts accept it)."""
    value = np.asarray(tensors.get(name, ()))
    if value.size == 0:
        return False
    if value.dtype == bool:
        return bool(value.any())
    if name in ("num_return_sequences", "beam_width"):
        return bool((value.astype(np.int64) > 1).any())
    return True


def refuse_uncarried(tensors: Mapping[str, Array]) -> None:
    """Refuse, naming it, the first input TensorRT-LLM's llmapi model would silently drop."""
    for name, field in UNCARRIED.items():
        if _asks_more_than_default(tensors, name):
            raise BadRequestError(UNCARRIED_REFUSAL.format(name=name, field=field), name)


def edge_request(tensors: Mapping[str, Array], prepare: Callable[..., Any],
                 decode: Callable[[list[int]], str]) -> EdgeResult:
    """One client request (batch of 1) -> what the llmapi model gets. prepare is PromptEdge.prepare
    (bounds, overflow policy, chat window, salt requirement); decode turns kept ids back into text."""
    if inputs.batch_size(tensors, "text_input", "messages") != 1:
        raise BadRequestError("the llmapi layout takes one request per call (batch size 1)")
    text = inputs.text_scalar(tensors, "text_input", 0) or ""
    messages, overflow, salt = (inputs.text_scalar(tensors, n, 0) for n in ("messages", "overflow", "cache_salt"))
    check_text_or_messages(text, messages)
    if salt:
        raise BadRequestError(SALT_REFUSAL, "cache_salt")
    given = next((name for name in RETENTION_NAMES if np.asarray(tensors.get(name, ())).size), None)
    if given:
        raise BadRequestError(RETENTION_REFUSAL.format(name=given), given)
    refuse_uncarried(tensors)
    max_tokens = _max_tokens(tensors)
    prompt = prepare(text, messages, overflow, salt, max_tokens)
    untouched = messages is None and not prompt.prompt_truncated_tokens
    return EdgeResult(text if untouched else decode(list(prompt.ids)), max_tokens,
                      inputs.flag(tensors, "stream", 0), tuple(inputs.words(tensors, "stop_words", 0)),
                      _sampling(tensors))


def llmapi_inputs(result: EdgeResult) -> dict[str, Array]:
    """The llmapi model's input tensors (its max_batch_size is 0: no batch dimension)."""
    tensors = {"text_input": np.array([result.text.encode("utf-8")], dtype=object),
               "streaming": np.array([result.stream], dtype=bool),
               "sampling_param_max_tokens": np.array([result.max_tokens], dtype=np.int32)}
    if result.stop:
        tensors["sampling_param_stop"] = np.array([w.encode("utf-8") for w in result.stop], dtype=object)
    for name, (value, dtype) in result.sampling.items():
        tensors[name] = np.array([value], dtype=dtype)
    return tensors


def core_outputs(wanted: frozenset[str]) -> list[str]:
    """The llmapi model's outputs to ask for: text_output and those renamed to what the client wants."""
    return [source for source, name in OUTPUT_NAMES.items() if name == "text_output" or name in wanted]


def ensemble_outputs(llmapi: Mapping[str, Array], wanted: frozenset[str]) -> dict[str, Array]:
    """The llmapi model's outputs under the ensemble's names, shaped [1, ...] (one request), for the
    outputs the client asked for (an empty `wanted`: text_output only)."""
    out: dict[str, Array] = {}
    for source, name in OUTPUT_NAMES.items():
        if source in llmapi and (name in wanted or name == "text_output"):
            value = np.asarray(llmapi[source]).reshape(1, -1)
            out[name] = _log_probs(value) if name == "cum_log_probs" else value
    return out


def _log_probs(value: Array) -> Array:
    """cumulative_logprob as FP32: model.py sends each CompletionOutput's value as text ("None" where the
    LLM API computed none, which becomes NaN rather than a made-up number)."""
    def parse(v: Any) -> float:
        text = v.decode("utf-8") if isinstance(v, bytes) else str(v)
        try:
            return float(text)
        except ValueError:
            return float("nan")
    return np.array([[parse(v) for v in row] for row in value], dtype=np.float32)

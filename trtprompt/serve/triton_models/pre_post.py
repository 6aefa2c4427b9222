"""`preprocessing` and `postprocessing` of the upstream (tensorrtllm_backend) layout.

Used by the GPU target's Triton ensemble and tested on CPU over the torch
`tensorrt_llm` model. Unlike tensorrtllm_backend's postprocessing, which
decodes every streamed chunk on its own (losing Metaspace spaces and
splitting UTF-8 characters), this one keeps a streaming detokenizer per
request id and returned sequence; it must run as ONE instance (two could
reorder chunks). On the trtllm target preprocessing also answers the core's
EMBEDDING_BIAS, and postprocessing publishes the request metrics the C++
backend does not export (RequestMetrics; docs/gpu.md, "Metrics").
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from trtprompt.engine.engine_dir import read_engine_dir
from trtprompt.engine.guide import check_guide
from trtprompt.error_codes import BadRequestError, FieldError
from trtprompt.interface import PERF_FLAG
from trtprompt.prompt.budget import PromptPolicy
from trtprompt.prompt.chat import parse_messages
from trtprompt.prompt.edge import PromptEdge, engine_dir_limits
from trtprompt.serve import metrics_catalog as C
from trtprompt.serve.triton_models import guided, inputs
from trtprompt.serve.triton_models import stub as io
from trtprompt.serve.triton_models.inputs import Array
from trtprompt.serve.triton_models.perf_observations import (
    COUNTERS,
    OBSERVED_OUTPUTS,
    TIMING_KEYS,
    FirstSeen,
    observation,
)
from trtprompt.serve.wire.refusals import refusal_reason, report_refused
from trtprompt.serve.wire.requests import check_text_or_messages
from trtprompt.tokenizer import StreamDetokenizer, Tokenizer

# The trtllm target's preprocessing (trtllm_model_config.PRE_BIAS_INPUTS / PRE_BIAS_OUTPUT): the ensemble's
# embedding_bias_words / _weights under tensorrtllm_backend's names, the core's embedding_bias out.
BIAS_IN: tuple[tuple[str, str], ...] = (("EMBEDDING_BIAS_WORDS", inputs.BIAS_WORDS),
                                        ("EMBEDDING_BIAS_WEIGHTS", inputs.BIAS_WEIGHTS))
BIAS_OUT = "EMBEDDING_BIAS"
# The trtllm target's postprocessing input (trtllm_model_config.POST_SEQUENCE_INPUT): the core's sequence_index.
SEQUENCE_INDEX = "SEQUENCE_INDEX"
Bias = tuple[tuple[int, float], ...]  # (token id, summed weight), as inputs.bias_from_words gives it
# The guide inputs under preprocessing's names (repository.PRE_GUIDE), in and out: checked, "" when none.
GUIDE_NAMES: tuple[tuple[str, str], ...] = tuple((name.upper(), name) for name in (guided.GUIDE_TYPE_INPUT,
                                                                                   guided.GUIDE_INPUT))
GUIDE_TYPES_PARAM = "guided_decoding_guide_types"  # the core's guide types, comma-separated; empty: off
GUIDED_OFF = ("input '{name}' cannot be honoured: guided decoding is off on this server (the trtllm target needs "
              "xgrammar_tokenizer_info.json in the engine directory; docs/gpu.md, \"Guided decoding\")")


def words_tensor(words: list[list[int]]) -> Array:
    """TensorRT-LLM's [2, L] words list (ids, end offsets), padded to L >= 1."""
    ids = [t for w in words for t in w]
    offsets = list(np.cumsum([len(w) for w in words])) if words else []
    width = max(1, len(ids))
    out = np.zeros((2, width), dtype=np.int32)
    out[1, :] = -1
    out[0, :len(ids)] = ids
    out[1, :len(offsets)] = offsets
    return out


def row_bias(tensors: dict[str, Array], i: int, encode: Callable[[str], list[int]], vocab_size: int) -> Bias:
    """Row i's embedding bias words and weights as (token, weight) pairs, built by the torch target's own
    helper (each word tokenized alone, every token given the word's weight, summed where words share one);
    a token past the engine's vocabulary would fail the request inside TensorRT-LLM, so it is refused here."""
    renamed = {ours: tensors[theirs] for theirs, ours in BIAS_IN if theirs in tensors}
    bias = inputs.bias_from_words(renamed, i, encode)
    bad = next((t for t, _ in bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequestError(f"input '{inputs.BIAS_WORDS}' has token {bad}, outside the engine's vocabulary "
                              f"({vocab_size} entries)", inputs.BIAS_WORDS)
    return bias


def bias_tensor(rows: list[Bias], vocab_size: int) -> Array:
    """EMBEDDING_BIAS: [rows, vocab_size] FP32 (TensorRT-LLM checks the length against its vocabulary), or
    [rows, 0] when no row has a bias: the backend reads an empty one as none, as tensorrtllm_backend's
    preprocessing sends it. A row without words beside one with words gets zeros, which change nothing."""
    if not any(rows):
        return np.zeros((len(rows), 0), dtype=np.float32)
    out = np.zeros((len(rows), vocab_size), dtype=np.float32)
    for r, bias in enumerate(rows):
        for token, weight in bias:
            out[r, token] = weight
    return out


class PreprocessingModel:
    """QUERY text -> INPUT_ID etc., one stream id per row."""

    def initialize(self, args: dict[str, str]) -> None:
        cfg, params = io.model_parameters(args)
        self.input_names = [t["name"] for t in cfg["input"]]
        self.tokenizer = Tokenizer.from_dir(params["tokenizer_dir"])
        self.add_special_tokens = io.param_bool(params, "add_special_tokens", True)
        engine = read_engine_dir(params["gpt_model_path"], params["tokenizer_dir"])
        chunked = io.param_bool(params, "enable_chunked_context", bool(engine.runtime.get("enable_chunked_context")))
        self.edge = PromptEdge(PromptPolicy.from_mapping(engine.prompt), self.tokenizer, self.add_special_tokens,
                               lambda: engine_dir_limits(engine, chunked))
        # The torch core takes a per-request salt; the tensorrtllm C++ backend declares no
        # such input, so there a salt could not keep tenants apart and is refused.
        self.salt_reaches_core = io.param_bool(params, "salt_reaches_core", True)
        # The trtllm target's ensemble routes return_perf_metrics through here: its postprocessing
        # needs the core's perf outputs on every request (docs/gpu.md, "Metrics").
        self.perf_flag = PERF_FLAG in {t["name"] for t in cfg["output"]}
        self.force_perf = io.param_bool(params, "force_perf_metrics", False)
        # EMBEDDING_BIAS where declared (trtllm target): as long as the engine's vocabulary, the length
        # TensorRT-LLM checks it against (the torch upstream layout declares none).
        declared = BIAS_OUT in {t["name"] for t in cfg["output"]}
        self.bias_size = int(engine.pretrained_config["vocab_size"]) if declared else None
        default_types = ",".join(guided.TRITON_GUIDE_TYPES)
        self.guide_types = tuple(t for t in params.get(GUIDE_TYPES_PARAM, default_types).split(",") if t)

    def _encode_word(self, word: str) -> list[int]:
        """A stop / bad / bias word's ids: tokenized alone, without special tokens (tensorrtllm_backend's)."""
        return self.tokenizer.encode(word, add_special_tokens=False)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                tensors = io.read_inputs(request, self.input_names)
                responses.append(pb_utils.InferenceResponse(output_tensors=self._outputs(tensors)))
            except Exception as exc:  # noqa: BLE001 - reported to the client
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=io.error_for(exc)))
                report_refused(refusal_reason(exc))
        return responses

    def _row(self, tensors: dict[str, Array], i: int) -> dict[str, Any]:
        tok = self.tokenizer
        text = inputs.text_scalar(tensors, "QUERY", i, "text_input") or ""
        messages, overflow, salt = (inputs.text_scalar(tensors, name.upper(), i, name)
                                    for name in ("messages", "overflow", "cache_salt"))
        check_text_or_messages(text, messages)
        if salt and not self.salt_reaches_core:
            raise BadRequestError("input 'cache_salt' cannot be honoured: Triton's tensorrtllm backend has no "
                                  "per-request cache salt input, so KV blocks could not be kept apart", "cache_salt")
        # A word of no tokens is dropped, as tensorrtllm_backend's preprocessing does: its empty entry would
        # repeat an offset, which TensorRT-LLM's word-list parser refuses.
        words = {name: [list(ids) for ids in inputs.word_ids(tensors, name, i, self._encode_word)]
                 for name in ("STOP_WORDS_DICT", "BAD_WORDS_DICT")}
        bias = () if self.bias_size is None else row_bias(tensors, i, self._encode_word, self.bias_size)
        guide_type, guide = self._guide(tensors, i)
        end_id = inputs.scalar(tensors, "END_ID", i, int)
        pad_id = inputs.scalar(tensors, "PAD_ID", i, int)
        eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        out_len = inputs.scalar(tensors, "REQUEST_OUTPUT_LEN", i, int)
        # budget, chat window, salt requirement: the fused ensemble's code (trtprompt.prompt.edge)
        chat = None if messages is None else parse_messages(messages)  # parsed once, here
        prompt = self.edge.prepare(text, chat, overflow, salt, out_len)
        return {"ids": prompt.ids, "out_len": out_len, "truncated": prompt.prompt_truncated_tokens,
                "dropped": prompt.dropped_turns, "bias": bias, "guide_type": guide_type, "guide": guide,
                "stop": words_tensor(words["STOP_WORDS_DICT"]), "bad": words_tensor(words["BAD_WORDS_DICT"]),
                "end_id": eos if end_id is None else end_id,
                "pad_id": (tok.pad_token_id if tok.pad_token_id is not None else eos) if pad_id is None else pad_id}

    def _outputs(self, tensors: dict[str, Array]) -> list[Any]:
        rows = [self._row(tensors, i) for i in range(inputs.batch_size(tensors, "QUERY"))]
        width = max(len(r["ids"]) for r in rows)
        ids = np.full((len(rows), width), rows[0]["pad_id"], dtype=np.int32)
        for i, r in enumerate(rows):
            ids[i, :len(r["ids"])] = r["ids"]

        def stack(key: str) -> Array:
            w = max(r[key].shape[1] for r in rows)
            out = np.zeros((len(rows), 2, w), dtype=np.int32)
            out[:, 1, :] = -1
            for i, r in enumerate(rows):
                out[i, :, :r[key].shape[1]] = r[key]
            return out

        def col(key: str, dtype: type[np.int32]) -> Array:
            return np.array([[r[key]] for r in rows], dtype=dtype)

        fixed = [pb_utils.Tensor("INPUT_ID", ids),
                 pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(r["ids"])] for r in rows], dtype=np.int32)),
                 pb_utils.Tensor("REQUEST_OUTPUT_LEN", col("out_len", np.int32)),
                 pb_utils.Tensor("STOP_WORDS_IDS", stack("stop")),
                 pb_utils.Tensor("BAD_WORDS_IDS", stack("bad")),
                 pb_utils.Tensor("OUT_END_ID", col("end_id", np.int32)),
                 pb_utils.Tensor("OUT_PAD_ID", col("pad_id", np.int32)),
                 pb_utils.Tensor("PROMPT_TRUNCATED_TOKENS", col("truncated", np.int32)),
                 pb_utils.Tensor("DROPPED_TURNS", col("dropped", np.int32))]
        guides = [pb_utils.Tensor(pre, np.array([[r[key].encode("utf-8")] for r in rows], dtype=object))
                  for (pre, _), key in zip(GUIDE_NAMES, ("guide_type", "guide"))]
        return fixed + guides + self._perf_flag(tensors, len(rows)) + self._bias([r["bias"] for r in rows])

    def _guide(self, tensors: dict[str, Array], i: int) -> tuple[str, str]:
        """The row's guide for the core, checked as the torch models check it (guided.guide_of; `json` with a
        schema becomes `json_schema`) against the types the core serves; ("", "") when none."""
        kind, text = (inputs.text_scalar(tensors, pre, i, name) for pre, name in GUIDE_NAMES)
        if not self.guide_types and (kind or text):
            raise BadRequestError(GUIDED_OFF.format(name=guided.GUIDE_TYPE_INPUT), guided.GUIDE_TYPE_INPUT)
        guide_type, guide = guided.guide_of(kind, text, self.guide_types)
        try:
            check_guide(guide_type, guide, None)  # its size bound, before the core compiles anything
        except FieldError as exc:
            name = guided.INPUT_OF_FIELD.get(exc.field, exc.field)
            raise BadRequestError(f"input '{name}' {exc.rule}", name) from None
        return guide_type or "", guide or ""

    def _bias(self, rows: list[Bias]) -> list[Any]:
        """EMBEDDING_BIAS for the core where declared (the trtllm target), on every request."""
        return [] if self.bias_size is None else [pb_utils.Tensor(BIAS_OUT, bias_tensor(rows, self.bias_size))]

    def _perf_flag(self, tensors: dict[str, Array], n: int) -> list[Any]:
        """RETURN_PERF_METRICS for the core where declared: forced true, else the client's (default false)."""
        if not self.perf_flag:
            return []
        rows = [[self.force_perf or inputs.flag(tensors, PERF_FLAG, i)] for i in range(n)]
        return [pb_utils.Tensor(PERF_FLAG, np.array(rows, dtype=bool))]


class PostprocessingModel:
    """TOKENS_BATCH -> OUTPUT text, incrementally per (request id, SEQUENCE_INDEX).

    The ensemble hands each composing model the client's request id; a
    request without one is decoded chunk by chunk on its own (tensorrtllm_
    backend's behaviour). With num_return_sequences > 1 the core interleaves
    the sequences' chunks under one request id, each response naming its
    sequence_index (absent: sequence 0), so each sequence has its own
    detokenizer. Triton lets this step see only tensorrt_llm's
    outputs, so the end of a stream is unknown: state is dropped least
    recently used or after stream_idle_timeout_s, and a partial character
    dangling at the very end of a stream is not flushed.
    """

    def initialize(self, args: dict[str, str]) -> None:
        cfg, params = io.model_parameters(args)
        self.input_names = [t["name"] for t in cfg["input"]]
        self.tokenizer = Tokenizer.from_dir(params["tokenizer_dir"])
        self.skip_special_tokens = io.param_bool(params, "skip_special_tokens", True)
        self.max_open = int(params.get("max_open_streams") or 4096)
        self.idle_timeout_s = float(params.get("stream_idle_timeout_s") or 600)
        self.streams: OrderedDict[tuple[str, int], tuple[StreamDetokenizer, float]] = OrderedDict()
        self.metrics: RequestMetrics | None = None
        if io.param_bool(params, "publish_request_metrics", False):  # trtllm target (docs/gpu.md, "Metrics")
            tokens_per_block = read_engine_dir(params["gpt_model_path"], params["tokenizer_dir"]).tokens_per_block
            self.metrics = RequestMetrics(tokens_per_block, self.max_open)

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                tensors = io.read_inputs(request, self.input_names)
                n = inputs.batch_size(tensors, "TOKENS_BATCH")
                key = request.request_id() if n == 1 else ""
                texts = [self._texts(tensors, i, key) for i in range(n)]
                if self.metrics is not None:
                    self.metrics.observe_batch(tensors, key, n)
                out = np.array([[t.encode("utf-8") for t in row] for row in texts], dtype=object)
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
            except Exception as exc:  # noqa: BLE001 - reported to the client
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=io.error_for(exc)))
        return responses

    def finalize(self) -> None:
        if self.metrics is not None:
            self.metrics.release()

    def _texts(self, tensors: dict[str, Array], i: int, key: str) -> list[str]:
        """Row i's text per beam ([batch, beam] as tensorrtllm_backend's OUTPUT): one beam streams through
        its request's detokenizer; a beam search's beams come whole, once, and are decoded whole."""
        tokens = np.asarray(tensors["TOKENS_BATCH"][i])
        if tokens.ndim < 2 or tokens.shape[0] == 1:
            return [self._text(tensors, i, key)]
        lengths = np.asarray(tensors["SEQUENCE_LENGTH"][i]).reshape(-1)
        return [self.tokenizer.decode([int(t) for t in tokens[k, :int(lengths[k])]],
                                      skip_special_tokens=self.skip_special_tokens) for k in range(tokens.shape[0])]

    def _text(self, tensors: dict[str, Array], i: int, key: str) -> str:
        length = int(np.asarray(tensors["SEQUENCE_LENGTH"][i]).reshape(-1)[0])
        tokens = [int(t) for t in np.asarray(tensors["TOKENS_BATCH"][i]).reshape(-1)[:length]]
        if not key:
            return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)
        sequence = inputs.scalar(tensors, SEQUENCE_INDEX, i, int)
        return self._stream((key, sequence or 0)).step(tokens)

    def _stream(self, key: tuple[str, int]) -> StreamDetokenizer:
        """This (request, sequence)'s detokenizer; expire idle ones (execute runs on one thread)."""
        now = time.monotonic()
        entry = self.streams.pop(key, None)
        detok = entry[0] if entry else self.tokenizer.stream(skip_special_tokens=self.skip_special_tokens)
        self.streams[key] = (detok, now)
        while len(self.streams) > self.max_open or now - next(iter(self.streams.values()))[1] > self.idle_timeout_s:
            self.streams.popitem(last=False)
        return detok


class RequestMetrics:
    """The trtllm target's request metrics, from the C++ core's perf outputs (perf_observations).

    The same families as the torch target's engine process publishes (metrics_catalog), one
    observation per request: every response repeats the perf outputs, so the first one that
    carries the first-token time is observed and its (request id, arrival time) remembered.
    """

    def __init__(self, tokens_per_block: int, capacity: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.seen = FirstSeen(capacity)
        self.families: list[Any] = []  # the families must outlive their metrics
        self.histograms = {h.timing_key: self._metric(h.name, h.help, "HISTOGRAM", list(h.buckets))
                           for h in C.HISTOGRAMS if h.timing_key in TIMING_KEYS}
        self.counters = {s.name: self._metric(s.name, s.help, "COUNTER", None)
                         for s in C.SERIES if s.name in COUNTERS}

    def _metric(self, name: str, help_text: str, kind: str, buckets: list[float] | None) -> Any:
        family = pb_utils.MetricFamily(name=name, description=help_text, kind=getattr(pb_utils.MetricFamily, kind))
        self.families.append(family)
        return family.Metric(labels={}, buckets=buckets) if buckets else family.Metric(labels={})

    def release(self) -> None:
        """Destroy the metrics, then their families, from finalize(): a family that outlives the model
        into the stub's own teardown sends its delete through a freed shared-memory pool and the stub
        segfaults (metrics_publisher.py's docstring; found on the torch target's models)."""
        self.histograms.clear()
        self.counters.clear()
        self.families.clear()

    def observe_batch(self, tensors: dict[str, Array], request_id: str, n: int) -> None:
        """Observe each row whose perf outputs came (never fails the response it rides on)."""
        try:
            for i in range(n):
                perf = {name: inputs.scalar(tensors, name.upper(), i, int) for name in OBSERVED_OUTPUTS}
                if None not in perf.values():
                    self.observe(request_id, perf)
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a response
            pb_utils.Logger.log_warn(f"trtprompt request metrics: {type(exc).__name__}: {exc}")

    def observe(self, request_id: str, perf: dict[str, int]) -> None:
        obs = observation(perf, self.tokens_per_block)
        if obs is None or not self.seen.first((request_id, perf["arrival_time_ns"])):
            return
        for key, value in obs.histograms.items():
            self.histograms[key].observe(value)
        for name, amount in obs.counters.items():
            if amount > 0:
                self.counters[name].increment(amount)

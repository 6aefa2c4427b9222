"""`preprocessing` and `postprocessing` of the upstream (tensorrtllm_backend) layout.

Used by the GPU target's Triton ensemble and tested on CPU over the torch
`tensorrt_llm` model. Unlike tensorrtllm_backend's postprocessing, which
decodes every streamed chunk on its own (losing Metaspace spaces and
splitting UTF-8 characters), this one keeps a streaming detokenizer per
request id; it must run as ONE instance (two could reorder chunks).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from trtprompt.engine_dir import read_engine_dir
from trtprompt.prompt.budget import PromptError, PromptPolicy
from trtprompt.prompt.edge import PromptEdge, engine_dir_limits
from trtprompt.serve import inputs, triton_io as io
from trtprompt.serve.metrics_engine import refusal_reason, report_refused
from trtprompt.tokenizer import StreamDetokenizer, Tokenizer


def words_tensor(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's [2, L] words list (ids, end offsets), padded to L >= 1."""
    ids = [t for w in words for t in w]
    offsets = list(np.cumsum([len(w) for w in words])) if words else []
    width = max(1, len(ids))
    out = np.zeros((2, width), dtype=np.int32)
    out[1, :] = -1
    out[0, :len(ids)] = ids
    out[1, :len(offsets)] = offsets
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

    def _row(self, tensors: dict[str, np.ndarray], i: int) -> dict[str, Any]:
        tok = self.tokenizer
        text = inputs.text_scalar(tensors, "QUERY", i, "text_input") or ""
        messages, overflow, salt = (inputs.text_scalar(tensors, name.upper(), i, name)
                                    for name in ("messages", "overflow", "cache_salt"))
        inputs.check_text_or_messages(text, messages)
        if salt and not self.salt_reaches_core:
            raise inputs.InputError("input 'cache_salt' cannot be honoured: Triton's tensorrtllm backend has no "
                                    "per-request cache salt input, so KV blocks could not be kept apart")
        words = {name: [tok.encode(w, add_special_tokens=False) for w in inputs.words(tensors, name, i)]
                 for name in ("STOP_WORDS_DICT", "BAD_WORDS_DICT")}
        end_id = inputs.scalar(tensors, "END_ID", i, int)
        pad_id = inputs.scalar(tensors, "PAD_ID", i, int)
        eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        out_len = inputs.scalar(tensors, "REQUEST_OUTPUT_LEN", i, int)
        try:  # budget, chat window, salt requirement: the fused ensemble's code (trtprompt.prompt.edge)
            prompt = self.edge.prepare(text, messages, overflow, salt, out_len)
        except PromptError as exc:
            raise inputs.InputError(str(exc), exc.code) from None
        return {"ids": prompt.ids, "out_len": out_len, "truncated": prompt.prompt_truncated_tokens,
                "dropped": prompt.dropped_turns,
                "stop": words_tensor(words["STOP_WORDS_DICT"]), "bad": words_tensor(words["BAD_WORDS_DICT"]),
                "end_id": eos if end_id is None else end_id,
                "pad_id": (tok.pad_token_id if tok.pad_token_id is not None else eos) if pad_id is None else pad_id}

    def _outputs(self, tensors: dict[str, np.ndarray]) -> list[Any]:
        rows = [self._row(tensors, i) for i in range(inputs.batch_size(tensors, "QUERY"))]
        width = max(len(r["ids"]) for r in rows)
        ids = np.full((len(rows), width), rows[0]["pad_id"], dtype=np.int32)
        for i, r in enumerate(rows):
            ids[i, :len(r["ids"])] = r["ids"]

        def stack(key: str) -> np.ndarray:
            w = max(r[key].shape[1] for r in rows)
            out = np.zeros((len(rows), 2, w), dtype=np.int32)
            out[:, 1, :] = -1
            for i, r in enumerate(rows):
                out[i, :, :r[key].shape[1]] = r[key]
            return out

        col = lambda key, dtype: np.array([[r[key]] for r in rows], dtype=dtype)  # noqa: E731
        return [pb_utils.Tensor("INPUT_ID", ids),
                pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(r["ids"])] for r in rows], dtype=np.int32)),
                pb_utils.Tensor("REQUEST_OUTPUT_LEN", col("out_len", np.int32)),
                pb_utils.Tensor("STOP_WORDS_IDS", stack("stop")),
                pb_utils.Tensor("BAD_WORDS_IDS", stack("bad")),
                pb_utils.Tensor("OUT_END_ID", col("end_id", np.int32)),
                pb_utils.Tensor("OUT_PAD_ID", col("pad_id", np.int32)),
                pb_utils.Tensor("PROMPT_TRUNCATED_TOKENS", col("truncated", np.int32)),
                pb_utils.Tensor("DROPPED_TURNS", col("dropped", np.int32))]


class PostprocessingModel:
    """TOKENS_BATCH -> OUTPUT text, incrementally per request id.

    The ensemble hands each composing model the client's request id; a
    request without one is decoded chunk by chunk on its own (tensorrtllm_
    backend's behaviour). Triton lets this step see only tensorrt_llm's
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
        self.streams: OrderedDict[str, tuple[StreamDetokenizer, float]] = OrderedDict()

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                tensors = io.read_inputs(request, self.input_names)
                n = inputs.batch_size(tensors, "TOKENS_BATCH")
                key = request.request_id() if n == 1 else ""
                texts = [self._text(tensors, i, key) for i in range(n)]
                out = np.array([[t.encode("utf-8")] for t in texts], dtype=object)
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
            except Exception as exc:  # noqa: BLE001 - reported to the client
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=io.error_for(exc)))
        return responses

    def _text(self, tensors: dict[str, np.ndarray], i: int, key: str) -> str:
        length = int(np.asarray(tensors["SEQUENCE_LENGTH"][i]).reshape(-1)[0])
        tokens = [int(t) for t in np.asarray(tensors["TOKENS_BATCH"][i]).reshape(-1)[:length]]
        if not key:
            return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)
        return self._stream(key).step(tokens)

    def _stream(self, key: str) -> StreamDetokenizer:
        """This request's detokenizer; expire idle ones (execute runs on one thread)."""
        now = time.monotonic()
        entry = self.streams.pop(key, None)
        detok = entry[0] if entry else self.tokenizer.stream(skip_special_tokens=self.skip_special_tokens)
        self.streams[key] = (detok, now)
        while len(self.streams) > self.max_open or now - next(iter(self.streams.values()))[1] > self.idle_timeout_s:
            self.streams.popitem(last=False)
        return detok

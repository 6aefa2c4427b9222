"""The torch target's `tensorrt_llm` model: token ids in, token ids out.

Takes TensorRT-LLM's core inputs (input_ids / input_lengths /
request_output_len, sampling inputs, streaming) and answers output_ids /
sequence_length, relaying to the engine process. Cancellation aborts the
engine request. It also publishes the engine's metrics.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from trtprompt.knobs import KNOBS
from trtprompt.serve.triton_models import guided, inputs
from trtprompt.serve.triton_models import stub as io
from trtprompt.serve.triton_models.inputs import Array
from trtprompt.serve.triton_models.lora_inputs import lora_input, send_adapter
from trtprompt.serve.triton_models.metrics_publisher import MetricsPublisher
from trtprompt.serve.triton_models.sequences import (
    SeqOutput,
    Sequences,
    beam_counts,
    beam_logprob_arrays,
    token_arrays,
)
from trtprompt.serve.wire import protocol as P
from trtprompt.serve.wire.frames import StepEntry
from trtprompt.serve.wire.outputs import seq_finished
from trtprompt.serve.wire.process import prefer_quick_thread_switches
from trtprompt.serve.wire.requests import TokenRequest

# Counts the upstream layout's preprocessing computed, handed back on every response: a Triton
# ensemble cannot mix preprocessing's outputs with this decoupled model's (repository.py).
ECHOED: tuple[str, ...] = ("prompt_truncated_tokens", "dropped_turns")


class _TokenRow:
    def __init__(self, model: "TokenModel", index: int, req: TokenRequest, echo: dict[str, int],
                 wanted: frozenset[str]) -> None:
        self.model, self.index, self.req, self.echo, self.wanted = model, index, req, echo, wanted
        self.sequences = Sequences()

    def engine_request(self) -> TokenRequest:
        return self.req

    def response(self, frame: StepEntry) -> list[Any] | None:
        """A streamed response per entry with new ids; otherwise one per sequence, when it ends
        (TensorRT-LLM's decoupled model answers each returned sequence apart)."""
        index, seq = self.sequences.add(frame)
        if self.req.sampling.beam_width > 1:
            return self._beams(frame) if frame["finished"] else None
        new, finished = frame["new_token_ids"], frame["finished"]
        if self.req.stream:
            ids = new
            if not ids and not finished:
                return None
        else:
            if not seq_finished(frame):
                return None
            ids = seq.ids if self.req.outputs.exclude_input_in_output else list(self.req.prompt_token_ids) + seq.ids
        out = [pb_utils.Tensor("output_ids", _ids_array(ids))] if "output_ids" in self.wanted else []
        values = {"sequence_length": (len(ids), "int32")}
        return out + self._per_token(seq) + self._scalars(frame, index, values, self.req.outputs.counts(frame))

    def _per_token(self, seq: SeqOutput) -> list[Any]:
        """The log probabilities and logits of the tokens this response brings, where asked for."""
        arrays = token_arrays(seq, self.req.outputs.return_log_probs, self.req.sampling, self.wanted)
        return [io.tensor(name, arr, "float32") for name, arr in arrays.items()]

    def _beams(self, frame: StepEntry) -> list[Any]:
        """A beam search's one response (TensorRT-LLM's shapes): output_ids [1, beams, longest] padded
        with end_id past each beam's sequence_length [1, beams], best first; streamed, outputs alone."""
        prompt = [] if self.req.outputs.exclude_input_in_output or self.req.stream else list(self.req.prompt_token_ids)
        beams = self.sequences.ranked()
        rows = [prompt + b.ids for b in beams]
        width = max(len(r) for r in rows)
        pad = self.req.sampling.end_id if self.req.sampling.end_id is not None else 0
        ids = np.full((1, len(rows), width), pad, dtype=np.int32)
        for k, row in enumerate(rows):
            ids[0, k, :len(row)] = row
        out = [pb_utils.Tensor("output_ids", ids)] if "output_ids" in self.wanted else []
        if "sequence_length" in self.wanted:
            out.append(io.tensor("sequence_length", [[len(r) for r in rows]], "int32"))
        if self.req.outputs.return_log_probs:
            out += [io.tensor(name, arr, "float32") for name, arr in beam_logprob_arrays(beams, self.wanted).items()]
        return out + self._scalars(frame, 0, {}, beam_counts(self.req.outputs.counts(frame), beams))

    def _scalars(self, frame: StepEntry, index: int, values: dict[str, tuple[int, str]],
                 counts: dict[str, int]) -> list[Any]:
        values = values | {"batch_index": (self.index, "int32"), "sequence_index": (index, "int32")}
        values |= {name: (value, "int32") for name, value in self.echo.items()}
        if self.req.outputs.return_perf_metrics:
            values |= inputs.perf_values(frame.get("stats") or {})
        values |= {k: (v, "int32") for k, v in counts.items()}
        return io.scalar_tensors(values, self.wanted)


def _echo(tensors: dict[str, Any], i: int) -> dict[str, int]:
    values = {name: inputs.scalar(tensors, name, i, int) for name in ECHOED}
    return {name: value for name, value in values.items() if value is not None}


def _ids_array(ids: list[int]) -> Array:
    # [batch=1, beam=1, tokens]; reshape keeps the shape right when empty.
    return np.asarray(ids, dtype=np.int32).reshape(1, 1, len(ids))


class TokenModel(io.RowModel):
    """TritonPythonModel for `tensorrt_llm` (decoupled)."""

    def initialize(self, args: dict[str, str]) -> None:
        prefer_quick_thread_switches()
        cfg, params = io.model_parameters(args)
        if guided.check_backend(params) == "xgrammar":  # anything but the two refuses to load, naming them
            pb_utils.Logger.log_info(guided.XGRAMMAR_NOTE)
        self.input_names = [t["name"] for t in cfg["input"]]
        self.socket = io.engine_socket(params)
        self.exclude_default = io.param_bool(params, "exclude_input_in_output", False)
        self.max_beam_width = int(params.get("max_beam_width") or 1)
        period_s = int(params.get("stats_check_period_ms") or KNOBS["stats_check_period_ms"].default) / 1000
        model_labels = {"model": args["model_name"], "version": str(args["model_version"])}
        self.metrics = MetricsPublisher(pb_utils, self.socket, period_s, model_labels).start()
        self.start_relay(self.socket, params)

    def engine_bounds(self) -> tuple[int, int]:
        """The engine's max_input_len and vocab_size, asked once (a model may load before the engine is up)."""
        if getattr(self, "_bounds", None) is None:
            info = P.call(self.socket, {"op": "info"})
            self._bounds = (int(info["max_input_len"]), int(info["vocab_size"]))
        return self._bounds

    def make_rows(self, tensors: dict[str, Any], wanted: frozenset[str]) -> list[_TokenRow]:
        n = inputs.batch_size(tensors, "input_ids")
        limit, vocab = self.engine_bounds()  # input_ids past the limit are refused before reaching the engine
        rows = [_TokenRow(self, i, inputs.parse_token_item(tensors, i, self.exclude_default, limit, vocab,
                                                           self.max_beam_width), _echo(tensors, i), wanted)
                for i in range(n)]
        for i in range(n):  # every row checked first: a refused request hands the engine nothing
            send_adapter(self.socket, lora_input(tensors, i))
        return rows

    def finalize(self) -> None:
        self.metrics.stop()
        super().finalize()

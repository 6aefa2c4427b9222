"""The torch target's `ensemble` model: text in, text out, streaming.

Tokenizes, submits to the engine process, detokenizes incrementally, and
aborts the engine request as soon as the client cancels (a Triton ensemble
could not: cancellation does not cross it, docs/design.md, "Triton facts").
"""

from __future__ import annotations

import functools
from typing import Any

from trtprompt.engine.engine_dir import read_engine_dir
from trtprompt.prompt.budget import PromptPolicy
from trtprompt.prompt.edge import PromptEdge
from trtprompt.serve.triton_models import inputs
from trtprompt.serve.triton_models import stub as io
from trtprompt.serve.triton_models.lora_inputs import lora_input, send_adapter
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
from trtprompt.serve.wire.requests import TextRequest, TokenRequest, prepare
from trtprompt.tokenizer import StreamDetokenizer, Tokenizer


class _TextRow:
    """One batch row: its prompt ids, a detokenizer per returned sequence, and response building."""

    def __init__(self, model: "TextModel", index: int, req: TextRequest, wanted: frozenset[str]) -> None:
        self.model, self.index, self.wanted = model, index, wanted
        self.stream, self.outputs = req.stream, req.outputs
        prepared = prepare(req, model.edge, model.tokenizer)
        self.request, self.prompt = prepared.request, prepared.prompt
        self.prompt_ids = list(self.request.prompt_token_ids)
        self.sequences = Sequences()
        self.detoks: dict[int, StreamDetokenizer] = {}
        self.beams = self.request.sampling.beam_width > 1

    def engine_request(self) -> TokenRequest:
        return self.request

    def _detok(self, index: int) -> StreamDetokenizer:
        # Detokenized in the prompt's context, so the first word keeps its
        # leading space (Metaspace), exactly as `trtprompt generate` prints it.
        if index not in self.detoks:
            self.detoks[index] = self.model.tokenizer.stream(self.prompt_ids,
                                                             skip_special_tokens=self.model.skip_special_tokens)
        return self.detoks[index]

    def response(self, frame: StepEntry) -> list[Any] | None:
        """Output tensors for this frame, or None when it adds nothing to send: streamed, the text it
        brings; otherwise a sequence's whole text once it ends (each sequence in its own response)."""
        index, seq = self.sequences.add(frame)
        if self.beams:
            return self._beams(frame) if frame["finished"] else None
        new, finished, detok = frame["new_token_ids"], frame["finished"], self._detok(index)
        if self.stream:
            text = detok.step(new) + (detok.flush() if seq_finished(frame) else "")
            if not text and not finished:
                return None
        elif not seq_finished(frame):
            return None
        else:
            text = self._whole(index, seq)
        out = [io.text_tensor("text_output", text)] if "text_output" in self.wanted else []
        return out + self._per_token(seq) + self._scalars(frame, index, self.outputs.counts(frame))

    def _per_token(self, seq: SeqOutput) -> list[Any]:
        """The log probabilities and logits of the tokens this response brings, where asked for."""
        arrays = token_arrays(seq, self.outputs.return_log_probs, self.request.sampling, self.wanted)
        return [io.tensor(name, arr, "float32") for name, arr in arrays.items()]

    def _whole(self, index: int, seq: SeqOutput) -> str:
        """A sequence's whole text: its output alone, or (TensorRT-LLM's default) prompt + output decoded
        together; streamed beams come whole but without the prompt, as streamed text does."""
        if self.outputs.exclude_input_in_output or self.stream:
            detok = self._detok(index)
            return detok.step(seq.ids) + detok.flush()
        skip = self.model.skip_special_tokens
        return self.model.tokenizer.decode(self.prompt_ids + seq.ids, skip_special_tokens=skip)

    def _beams(self, frame: StepEntry) -> list[Any]:
        """A beam search's one response: text_output [1, beams], best first (docs/triton-inputs.md)."""
        beams = self.sequences.ranked()
        texts = [self._whole(k, beam).encode("utf-8") for k, beam in enumerate(beams)]
        out = [io.tensor("text_output", [texts], "object")] if "text_output" in self.wanted else []
        if self.outputs.return_log_probs:
            out += [io.tensor(name, arr, "float32") for name, arr in beam_logprob_arrays(beams, self.wanted).items()]
        return out + self._scalars(frame, 0, beam_counts(self.outputs.counts(frame), beams))

    def _scalars(self, frame: StepEntry, index: int, counts: dict[str, int]) -> list[Any]:
        values = {"batch_index": (self.index, "int32"), "sequence_index": (index, "int32"),
                  "prompt_truncated_tokens": (self.prompt.prompt_truncated_tokens, "int32"),
                  "dropped_turns": (self.prompt.dropped_turns, "int32")}
        if self.outputs.return_perf_metrics and (frame["finished"] or not self.outputs.perf_final_only):
            values |= inputs.perf_values(frame.get("stats") or {})
        values |= {k: (v, "int32") for k, v in counts.items()}
        return io.scalar_tensors(values, self.wanted)


class TextModel(io.RowModel):
    """TritonPythonModel for `ensemble` (decoupled)."""

    def initialize(self, args: dict[str, str]) -> None:
        prefer_quick_thread_switches()
        cfg, params = io.model_parameters(args)
        self.input_names = [t["name"] for t in cfg["input"]]
        self.tokenizer = Tokenizer.from_dir(params["tokenizer_dir"])
        self.socket = io.engine_socket(params)
        self.exclude_default = io.param_bool(params, "exclude_input_in_output", False)
        self.add_special_tokens = io.param_bool(params, "add_special_tokens", True)
        self.skip_special_tokens = io.param_bool(params, "skip_special_tokens", True)
        self.max_beam_width = int(params.get("max_beam_width") or 1)
        policy = PromptPolicy.from_mapping(read_engine_dir(params["gpt_model_path"], params["tokenizer_dir"]).prompt)
        self.edge = PromptEdge(policy, self.tokenizer, self.add_special_tokens,
                               functools.partial(P.engine_limits, self.socket))
        self.start_relay(self.socket, params)

    def make_rows(self, tensors: dict[str, Any], wanted: frozenset[str]) -> list[_TextRow]:
        n = inputs.batch_size(tensors, "text_input", "messages")
        rows = [_TextRow(self, i, inputs.parse_text_item(tensors, i, self.exclude_default, self.encode_word,
                                                         self.max_beam_width), wanted) for i in range(n)]
        for i in range(n):  # every row checked first: a refused request hands the engine nothing
            send_adapter(self.socket, lora_input(tensors, i))
        return rows

    def encode_word(self, word: str) -> list[int]:
        """A bad word's or bias word's ids: tokenized alone, without special tokens (as stop words are)."""
        return self.tokenizer.encode(word, add_special_tokens=False)

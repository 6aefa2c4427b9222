"""The torch target's `ensemble` model: text in, text out, streaming.

Tokenizes, submits to the engine process, detokenizes incrementally, and
aborts the engine request as soon as the client cancels (a Triton ensemble
could not: cancellation does not cross it, docs/design.md, "Triton facts").
"""

from __future__ import annotations

import functools
from typing import Any

from trtprompt.engine_dir import read_engine_dir
from trtprompt.prompt.budget import PromptPolicy
from trtprompt.prompt.edge import EdgePrompt, PromptEdge
from trtprompt.serve import inputs, protocol as P, triton_io as io
from trtprompt.tokenizer import Tokenizer


class _TextRow:
    """One batch row: its prompt ids, detokenizer and response building."""

    def __init__(self, model: "TextModel", index: int, item: inputs.Item, wanted: frozenset[str]) -> None:
        tok = model.tokenizer
        self.model, self.index, self.item, self.wanted = model, index, item, wanted
        self.prompt: EdgePrompt
        self.prompt, self.params = inputs.text_request(item, model.edge, tok)
        self.prompt_ids = self.prompt.ids
        # Detokenized in the prompt's context, so the first word keeps its
        # leading space (Metaspace), exactly as `trtprompt generate` prints it.
        self.detok = tok.stream(self.prompt_ids, skip_special_tokens=model.skip_special_tokens)
        self.output_ids: list[int] = []

    def engine_request(self) -> io.RowRequest:
        item = self.item
        # Final outputs carry the request's stats anyway: per-step stats only when every response needs them.
        every_response = item.return_perf_metrics and not item.perf_final_only
        return io.RowRequest(self.prompt_ids, self.params, item.cache_salt, every_response)

    def response(self, frame: dict[str, Any]) -> list[Any] | None:
        """Output tensors for this frame, or None when it adds nothing to send."""
        new, finished = frame["new_token_ids"], frame["finished"]
        self.output_ids.extend(new)
        if self.item.stream:
            text = self.detok.step(new) + (self.detok.flush() if finished else "")
            if not text and not finished:
                return None
        elif not finished:
            return None
        elif self.item.exclude_input_in_output:
            text = self.detok.step(self.output_ids) + self.detok.flush()
        else:  # TensorRT-LLM returns prompt + output, decoded together
            text = self.model.tokenizer.decode(self.prompt_ids + self.output_ids,
                                               skip_special_tokens=self.model.skip_special_tokens)
        return self._tensors(text, frame)

    def _tensors(self, text: str, frame: dict[str, Any]) -> list[Any]:
        out = [io.text_tensor("text_output", text)] if "text_output" in self.wanted else []
        values = {"batch_index": (self.index, "int32"), "sequence_index": (0, "int32"),
                  "prompt_truncated_tokens": (self.prompt.prompt_truncated_tokens, "int32"),
                  "dropped_turns": (self.prompt.dropped_turns, "int32")}
        if self.item.return_perf_metrics and (frame["finished"] or not self.item.perf_final_only):
            values |= inputs.perf_values(frame["stats"])
        values |= {k: (v, "int32") for k, v in inputs.count_values(self.item, frame).items()}
        return out + io.scalar_tensors(values, self.wanted)


class TextModel(io.RowModel):
    """TritonPythonModel for `ensemble` (decoupled)."""

    def initialize(self, args: dict[str, str]) -> None:
        io.prefer_quick_thread_switches()
        cfg, params = io.model_parameters(args)
        self.input_names = [t["name"] for t in cfg["input"]]
        self.tokenizer = Tokenizer.from_dir(params["tokenizer_dir"])
        self.socket = io.engine_socket(params)
        self.exclude_default = io.param_bool(params, "exclude_input_in_output", False)
        self.add_special_tokens = io.param_bool(params, "add_special_tokens", True)
        self.skip_special_tokens = io.param_bool(params, "skip_special_tokens", True)
        policy = PromptPolicy.from_mapping(read_engine_dir(params["gpt_model_path"], params["tokenizer_dir"]).prompt)
        self.edge = PromptEdge(policy, self.tokenizer, self.add_special_tokens,
                               functools.partial(P.engine_limits, self.socket))
        self.start_relay(self.socket, params)

    def make_rows(self, tensors: dict[str, Any], wanted: frozenset[str]) -> list[_TextRow]:
        n = inputs.batch_size(tensors, "text_input", "messages")
        return [_TextRow(self, i, inputs.parse_text_item(tensors, i, self.exclude_default), wanted)
                for i in range(n)]

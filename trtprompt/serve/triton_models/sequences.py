"""What the Triton models keep per returned sequence: its output so far and its log probabilities.

A request with num_return_sequences = n gets n sequences from one prompt; the engine's entries say
which one each belongs to (serve/wire/outputs.py: `seq`, `seq_finished`). As TensorRT-LLM does, each
response carries one sequence with its `sequence_index`; with return_log_probs it also carries
`cum_log_probs` ([1, 1]: batch, beam) and `output_log_probs` ([1, 1, tokens]), the log probabilities
of the tokens that response brings (streaming) or of the whole output (not streaming).

A beam search (beam_width > 1) is answered as TensorRT-LLM answers it: every returned beam in one
response, at the end (the engine reports beams only once the search is done, streaming or not), each
output with a beam dimension: `cum_log_probs` [1, beams], and no `output_log_probs` (the engine computes
no per-token values for beams; docs/triton-inputs.md).

Stdlib and numpy only: tested outside Triton's stub.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from trtprompt.serve.wire.outputs import seq_of, token_logprobs

Array = np.ndarray[Any, Any]
LOGPROB_OUTPUTS = ("cum_log_probs", "output_log_probs")


class SeqOutput:
    """One returned sequence: its token ids and the log probabilities not yet sent."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.sent = 0  # logprobs[:sent] went out already
        self.cum = 0.0

    def add(self, entry: Mapping[str, Any]) -> None:
        self.ids.extend(entry["new_token_ids"])
        lps = token_logprobs(entry)
        if lps is not None:
            self.logprobs.extend(lp.logprob for lp in lps)
        if entry.get("cum_logprob") is not None:  # with the logprobs, or a beam's alone
            self.cum = float(entry["cum_logprob"])

    def take_logprobs(self) -> list[float]:
        """The log probabilities gathered since the last response: a streamed response that had no
        text to carry (a partial character) leaves its tokens' ones to the next."""
        out = self.logprobs[self.sent:]
        self.sent = len(self.logprobs)
        return out


class Sequences:
    """A row's sequences by index, made as their first entry arrives."""

    def __init__(self) -> None:
        self.by_index: dict[int, SeqOutput] = {}

    def add(self, entry: Mapping[str, Any]) -> tuple[int, SeqOutput]:
        index = seq_of(entry)
        seq = self.by_index.setdefault(index, SeqOutput())
        seq.add(entry)
        return index, seq

    def ranked(self) -> list[SeqOutput]:
        """The sequences by index: a beam search's best first."""
        return [self.by_index[k] for k in sorted(self.by_index)]


def logprob_arrays(seq: SeqOutput, wanted: frozenset[str]) -> dict[str, Array]:
    """cum_log_probs and output_log_probs for one response, shaped as TensorRT-LLM's (batch, beam first);
    only those the client asked for."""
    new = seq.take_logprobs()
    arrays = {"cum_log_probs": np.asarray([[seq.cum]], dtype=np.float32),
              "output_log_probs": np.asarray(new, dtype=np.float32).reshape(1, 1, len(new))}
    return {name: arr for name, arr in arrays.items() if name in wanted}


def beam_logprob_arrays(beams: list[SeqOutput], wanted: frozenset[str]) -> dict[str, Array]:
    """A beam search's cum_log_probs, [1, beams] (batch, beam), if the client asked for it."""
    cum = np.asarray([[b.cum for b in beams]], dtype=np.float32)
    return {"cum_log_probs": cum} if "cum_log_probs" in wanted else {}


def beam_counts(counts: Mapping[str, int], beams: list[SeqOutput]) -> dict[str, int]:
    """num_input_tokens as asked; num_output_tokens summed over the returned beams (as OpenAI's usage counts
    every choice), the beams coming in one response."""
    summed = {"num_output_tokens": sum(len(b.ids) for b in beams)} if "num_output_tokens" in counts else {}
    return dict(counts) | summed

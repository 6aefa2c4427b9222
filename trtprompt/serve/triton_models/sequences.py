"""What the Triton models keep per returned sequence: its output so far, its log probabilities and logits.

A request with num_return_sequences = n gets n sequences from one prompt; the engine's entries say
which one each belongs to (serve/wire/outputs.py: `seq`, `seq_finished`). As TensorRT-LLM does, each
response carries one sequence with its `sequence_index`; with return_log_probs it also carries
`cum_log_probs` ([1, 1]: batch, beam) and `output_log_probs` ([1, 1, tokens]), the log probabilities
of the tokens that response brings (streaming) or of the whole output (not streaming). With
return_generation_logits it carries `generation_logits` ([1, 1, tokens, vocab]: batch, beam) of the same
tokens, and with return_context_logits its first response of sequence 0 carries `context_logits`
([1, prompt tokens, vocab]); both raw float32, as the engine returns them (serve/wire/outputs.py).

A beam search (beam_width > 1) is answered as TensorRT-LLM answers it: every returned beam in one
response, at the end (the engine reports beams only once the search is done, streaming or not), each
output with a beam dimension: `cum_log_probs` [1, beams], and no `output_log_probs` nor logits (the
engine computes no per-token values for beams, and refuses the logits flags with them;
docs/triton-inputs.md).

Stdlib and numpy only: tested outside Triton's stub.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from trtprompt.serve.wire.outputs import Logits, logits_of, seq_of, token_logprobs

if TYPE_CHECKING:
    from trtprompt.engine.request import SamplingParams

Array = np.ndarray[Any, Any]
LOGPROB_OUTPUTS = ("cum_log_probs", "output_log_probs")
LOGITS_OUTPUTS = ("context_logits", "generation_logits")


def _rows(logits: Logits) -> Array:
    """An entry's logits as a [rows, vocab] float32 array (a copy: the entry's bytes are not kept)."""
    return np.frombuffer(logits.data, dtype="<f4").reshape(logits.rows, logits.cols).astype(np.float32)


class SeqOutput:
    """One returned sequence: its token ids and the log probabilities not yet sent."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.sent = 0  # logprobs[:sent] went out already
        self.cum = 0.0
        self.context: Array | None = None  # [prompt tokens, vocab] until a response takes it
        self.generation: list[Array] = []  # [tokens, vocab] pieces no response has taken yet
        self.vocab = 0  # the logits' width, once an entry brought some

    def add(self, entry: Mapping[str, Any]) -> None:
        self.ids.extend(entry["new_token_ids"])
        lps = token_logprobs(entry)
        if lps is not None:
            self.logprobs.extend(lp.logprob for lp in lps)
        if entry.get("cum_logprob") is not None:  # with the logprobs, or a beam's alone
            self.cum = float(entry["cum_logprob"])
        self._add_logits(entry)

    def _add_logits(self, entry: Mapping[str, Any]) -> None:
        context, generation = (logits_of(entry, name) for name in LOGITS_OUTPUTS)
        if context is not None:
            self.context, self.vocab = _rows(context), context.cols
        if generation is not None:
            self.generation.append(_rows(generation))
            self.vocab = generation.cols

    def take_logprobs(self) -> list[float]:
        """The log probabilities gathered since the last response: a streamed response that had no
        text to carry (a partial character) leaves its tokens' ones to the next."""
        out = self.logprobs[self.sent:]
        self.sent = len(self.logprobs)
        return out

    def take_generation(self) -> Array:
        """The generation logits gathered since the last response, [tokens, vocab] (as take_logprobs)."""
        rows = np.concatenate(self.generation) if self.generation else np.zeros((0, self.vocab), np.float32)
        self.generation = []
        return rows

    def take_context(self) -> Array | None:
        """The context logits, to the first response after they came; None after (and on sequences > 0)."""
        context, self.context = self.context, None
        return context


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


def logits_arrays(seq: SeqOutput, context: bool, generation: bool, wanted: frozenset[str]) -> dict[str, Array]:
    """context_logits [1, prompt tokens, vocab] (on the first response once the prompt is computed) and
    generation_logits [1, 1, tokens, vocab] of the tokens this response brings (batch, beam first), as
    TensorRT-LLM shapes them; context / generation: what the request asked for. Taken even when the client
    named other outputs, so that rows never pile up."""
    arrays: dict[str, Array] = {}
    rows = seq.take_context() if context else None
    if rows is not None:
        arrays["context_logits"] = rows[np.newaxis]
    if generation:
        arrays["generation_logits"] = seq.take_generation()[np.newaxis, np.newaxis]
    return {name: arr for name, arr in arrays.items() if name in wanted}


def token_arrays(seq: SeqOutput, log_probs: bool, sampling: "SamplingParams",
                 wanted: frozenset[str]) -> dict[str, Array]:
    """Every per-token output of one response the request asked for (return_log_probs and the sampling's
    logits flags) and the client named: the FP32 tensors both models send alike."""
    arrays = logprob_arrays(seq, wanted) if log_probs else {}
    return arrays | logits_arrays(seq, sampling.return_context_logits, sampling.return_generation_logits, wanted)


def beam_logprob_arrays(beams: list[SeqOutput], wanted: frozenset[str]) -> dict[str, Array]:
    """A beam search's cum_log_probs, [1, beams] (batch, beam), if the client asked for it."""
    cum = np.asarray([[b.cum for b in beams]], dtype=np.float32)
    return {"cum_log_probs": cum} if "cum_log_probs" in wanted else {}


def beam_counts(counts: Mapping[str, int], beams: list[SeqOutput]) -> dict[str, int]:
    """num_input_tokens as asked; num_output_tokens summed over the returned beams (as OpenAI's usage counts
    every choice), the beams coming in one response."""
    summed = {"num_output_tokens": sum(len(b.ids) for b in beams)} if "num_output_tokens" in counts else {}
    return dict(counts) | summed

"""An engine request's step entries as the front end's pieces, per sequence (n > 1 reports each apart).

A streamed sequence's piece carries the text its entry completes and the log probabilities of the
tokens that text came from: a token whose text the incremental detokenizer holds back (a split
character, a word boundary) rides with the piece that releases it. Unstreamed, a sequence is
decoded whole once it ends, as the fused ensemble does. With `echo` the first piece of each
sequence starts with the prompt's text and, with logprobs, the prompt tokens' log probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from trtprompt.serve.openai.answer_params import Shape
from trtprompt.serve.openai.logprobs import Candidate, TokenLogprob
from trtprompt.serve.openai.to_triton import Piece
from trtprompt.serve.wire.outputs import (
    Logprob,
    end_logprob,
    prompt_logprobs,
    seq_finished,
    seq_of,
    token_logprobs,
)
from trtprompt.tokenizer import StreamDetokenizer, Tokenizer


@dataclass(frozen=True)
class Echo:
    """What `echo` puts before each sequence's output."""

    text: str
    prompt_ids: tuple[int, ...]


@dataclass
class _Sequence:
    """One sequence's decoding state (mutable: it lives as long as its request)."""

    detok: StreamDetokenizer
    pending: list[int] = field(default_factory=list)  # token ids not decoded yet (unstreamed: all of them)
    held: list[TokenLogprob] = field(default_factory=list)  # log probabilities whose text is not out yet
    started: bool = False


class PieceReader:
    """Reads one engine request's entries; one per request."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], shape: Shape, stream: bool,
                 skip_special_tokens: bool, echo: Echo | None) -> None:
        self._tok, self._prompt_ids, self._shape = tokenizer, list(prompt_ids), shape
        # Log probabilities shown in the answer (best_of only ranks by the entries' cum_logprob)
        self._logprobs = shape.logprobs is not None or shape.prompt_logprobs is not None
        self._stream, self._skip, self._echo = stream, skip_special_tokens, echo
        self._seqs: dict[int, _Sequence] = {}
        self._prompt: tuple[TokenLogprob, ...] | None = None
        self._names: dict[int, str] = {}

    def read(self, entry: Mapping[str, Any]) -> Piece | None:
        """The piece this entry makes, if any (a held-back text makes none until released)."""
        state = self._sequence(seq_of(entry))
        done = seq_finished(entry)
        state.pending += entry.get("new_token_ids") or []
        if self._logprobs:  # a request that asked for none skips the readers (one per streamed token)
            self._read_logprobs(entry, state)
        if not (self._stream or done):
            return None
        text = state.detok.step(state.pending) + (state.detok.flush() if done else "")
        state.pending = []
        first = not state.started
        if not (text or done or (first and self._echo is not None)):
            return None
        state.started = True
        return self._piece(entry, state, text, first, done)

    def _read_logprobs(self, entry: Mapping[str, Any], state: _Sequence) -> None:
        if (raw := prompt_logprobs(entry)) is not None and self._prompt is None:
            self._prompt = self._prompt_logprobs(raw)  # once per request; every sequence's echo shows it
        state.held += [self._named(lp) for lp in token_logprobs(entry) or []]
        if (end := end_logprob(entry)) is not None:
            # The end token is no output text, but its log probability is listed last, as vLLM lists it:
            # lm-evaluation-harness drops the last entry as the generated token's.
            state.held.append(self._named(end))

    def _sequence(self, seq: int) -> _Sequence:
        if seq not in self._seqs:
            self._seqs[seq] = _Sequence(StreamDetokenizer(self._tok, self._prompt_ids, self._skip))
        return self._seqs[seq]

    def _piece(self, entry: Mapping[str, Any], state: _Sequence, text: str, first: bool, done: bool) -> Piece:
        lps: list[TokenLogprob] | None = None
        if "logprobs" in entry or state.held or (first and self._echoes_logprobs):
            lps = list(self._prompt or ()) if first and self._echoes_logprobs else []
            lps += state.held
            state.held = []
        if first and self._echo is not None:
            text = self._echo.text + text
        stats = entry.get("stats") or {}  # the request's final entry carries its stats
        reused = stats.get("kv_cache_reused_blocks")
        return Piece(text, entry.get("num_input_tokens"), entry.get("num_output_tokens"),
                     None if reused is None else int(reused), seq_of(entry), None if lps is None else tuple(lps),
                     entry.get("cum_logprob"), self._prompt if first else None,
                     entry.get("finish_reason") if done else None)

    @property
    def _echoes_logprobs(self) -> bool:
        return self._echo is not None and self._shape.logprobs is not None

    def _prompt_logprobs(self, raw: list[Logprob | None]) -> tuple[TokenLogprob, ...]:
        first = Candidate(self._prompt_ids[0], self._name(self._prompt_ids[0]), 0.0)
        return (TokenLogprob(first, (), scored=False),) + tuple(self._named(lp) for lp in raw[1:] if lp is not None)

    def _named(self, lp: Logprob) -> TokenLogprob:
        return TokenLogprob(Candidate(lp.token_id, self._name(lp.token_id), lp.logprob),
                            tuple(Candidate(t, self._name(t), v) for t, v in lp.top))

    def _name(self, token_id: int) -> str:
        """The token decoded alone, special tokens included (cached: top-k names repeat)."""
        if token_id not in self._names:
            self._names[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return self._names[token_id]

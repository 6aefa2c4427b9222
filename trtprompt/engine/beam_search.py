"""Beam search for one request: which beams go on with which token, and which sequences are done.

The rules are transformers' (`generate(num_beams=W, do_sample=False)`, the oracle of
tests/test_engine_beams.py), which TensorRT-LLM's length penalty and early stopping also follow:

- Each step every running beam's log_softmax row is added to its accumulated score, and the best
  2W (beam, token) candidates over all beams are kept, best first.
- A candidate ending in an end token, or reaching max_tokens, is a finished hypothesis, scored
  accumulated / generated_length ** length_penalty; only the W best candidates may finish, and the
  W best finished hypotheses are kept. The W best candidates that did not finish run on.
- early_stopping True: done once W hypotheses are finished. False: done also when the best running
  beam, scored at its current length, cannot beat the worst finished one. "never": as False, but a
  positive length penalty scores the running beam at the longest length it could reach.

Pure: no KV, no requests; engine/beams.py applies its decisions to the sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

EarlyStopping = bool | Literal["never"]
# transformers' stand-in for "no score": a candidate that cannot be chosen
NO_SCORE = -1.0e9


@dataclass(frozen=True)
class Hypothesis:
    """A finished sequence: its generated tokens (an end token kept last), length-penalized score and
    the plain sum of its tokens' log probabilities."""

    tokens: tuple[int, ...]
    score: float
    sum_logprob: float
    ended_by_end_id: bool


@dataclass(frozen=True)
class BeamStep:
    """One step's decision: beam i of the next step continues beam parents[i] with tokens[i]."""

    parents: tuple[int, ...]
    tokens: tuple[int, ...]
    done: bool


@dataclass
class BeamSearch:
    width: int
    max_new_tokens: int
    end_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    generated: int = 0  # tokens each running beam holds
    running: list[list[int]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # accumulated log probability per running beam
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True

    def __post_init__(self) -> None:
        if self.width < 2:
            raise ValueError(f"width must be >= 2 for beam search, got {self.width}")
        # Every beam starts as the prompt: only the first one's candidates count at the first step.
        self.running = [[] for _ in range(self.width)]
        self.scores = [0.0] + [NO_SCORE] * (self.width - 1)

    def step(self, logprobs: torch.Tensor) -> BeamStep:
        """logprobs: [width, vocab] log_softmax rows of the running beams, in beam order."""
        cand_scores, cand_beams, cand_tokens = self._candidates(logprobs)
        hits = [t in self.end_ids or self.generated + 1 >= self.max_new_tokens for t in cand_tokens]
        self._finish(cand_scores, cand_beams, cand_tokens, hits)
        order = sorted(range(len(cand_scores)), key=lambda c: -(cand_scores[c] + (NO_SCORE if hits[c] else 0.0)))
        keep = order[:self.width]
        parents = tuple(cand_beams[c] for c in keep)
        tokens = tuple(cand_tokens[c] for c in keep)
        self.running = [self.running[p] + [t] for p, t in zip(parents, tokens)]
        self.scores = [cand_scores[c] + (NO_SCORE if hits[c] else 0.0) for c in keep]
        self.generated += 1
        self._update_improvable()
        done = not self.improvable or (self._full() and self.early_stopping is True) or all(hits)
        return BeamStep(parents, tokens, done)

    def _candidates(self, logprobs: torch.Tensor) -> tuple[list[float], list[int], list[int]]:
        """The 2W best (accumulated score, beam, token), best first."""
        acc = logprobs.float() + torch.tensor(self.scores, dtype=torch.float32).unsqueeze(1)
        values, index = torch.topk(acc.reshape(-1), 2 * self.width)
        vocab = logprobs.shape[-1]
        flat = index.tolist()
        return values.tolist(), [i // vocab for i in flat], [i % vocab for i in flat]

    def _finish(self, scores: list[float], beams: list[int], tokens: list[int], hits: list[bool]) -> None:
        """Candidates among the W best that finished join the hypotheses, if they rank."""
        if not self.improvable or (self._full() and self.early_stopping is True):
            return
        length = self.generated + 1
        for c in range(self.width):
            if hits[c]:
                seq = tuple(self.running[beams[c]] + [tokens[c]])
                self.finished.append(Hypothesis(seq, scores[c] / length ** self.length_penalty, scores[c],
                                                tokens[c] in self.end_ids))
        # Stable: an earlier hypothesis wins a tie, as transformers' merge keeps the old ones first.
        self.finished = sorted(self.finished, key=lambda h: -h.score)[:self.width]

    def _full(self) -> bool:
        return len(self.finished) == self.width

    def _update_improvable(self) -> None:
        """Can a running beam still beat the worst finished hypothesis? (transformers' heuristic)"""
        if not self._full():
            return  # an empty slot is worth -1e9: anything beats it
        never = self.early_stopping == "never" and self.length_penalty > 0.0
        length = self.max_new_tokens if never else self.generated
        best_possible = self.scores[0] / length ** self.length_penalty
        self.improvable = self.improvable and best_possible > self.finished[-1].score

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]

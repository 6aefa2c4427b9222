"""Beam searches in flight: their beams are sequences of one request, stepped together.

A request with beam_width W holds W sequences (LLMEngine.groups). Sequence 0 computes the prompt;
the others wait, holding nothing, until the first step forks them from it. Each step every running
beam computes its logits row; once all W rows are in, BeamSearch decides which beam each continues
and with which token, and the KV follows: a beam continued once keeps its blocks, one continued
twice has the second continuation take the blocks of a beam that was dropped, its full blocks
shared and its partial last block copied (KVCacheManager.reseat). A beam whose row is in waits
(it has nothing to compute until its token comes), so a step that scheduled only some beams
delays the search, never breaks it.

When the search is done its best n hypotheses are the request's sequences, reported once at the
end (TensorRT-LLM reports beams whole too), each with its summed log probability.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from trtprompt.engine.beam_search import BeamSearch, BeamStep, Hypothesis
from trtprompt.engine.kv_cache import KVCacheManager
from trtprompt.engine.request import FinishReason, Request, RequestStatus
from trtprompt.engine.scheduler import Scheduler

CopyBlocks = Callable[[list[tuple[int, int]]], None]


@dataclass
class _Search:
    search: BeamSearch
    beams: list[Request]  # slot i holds beam i
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> this step's log_softmax row


class BeamSearches:
    """Owned by the engine; not thread-safe (the engine loop owns it)."""

    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, copy_blocks: CopyBlocks) -> None:
        self.kv = kv
        self.scheduler = scheduler
        self.copy_blocks = copy_blocks
        self._by_request: dict[str, _Search] = {}

    def start(self, group: list[Request]) -> None:
        first = group[0]
        p = first.params
        self._by_request[first.group_id] = _Search(
            BeamSearch(p.beam_width, first.max_output_tokens, first.end_ids, p.length_penalty, p.early_stopping),
            list(group))

    def owns(self, req: Request) -> bool:
        return req.group_id in self._by_request

    def forget(self, group_id: str) -> None:
        self._by_request.pop(group_id, None)

    def collect(self, req: Request, logits: torch.Tensor) -> list[Hypothesis] | None:
        """req's logits row for the current step; when it completes the step, the step runs. Returns
        the best hypotheses once the search is done (the caller finishes the request), else None."""
        state = self._by_request[req.group_id]
        state.rows[state.beams.index(req)] = torch.log_softmax(logits.float(), dim=-1)
        if state.search.generated == 0:  # the prompt's row stands for every beam at the first step
            state.rows = {i: state.rows[0] for i in range(len(state.beams))}
        if not self._complete(state):
            return None
        rows = torch.stack([state.rows[i] for i in range(len(state.beams))])
        state.rows = {}
        decision = state.search.step(rows)
        if decision.done:
            return state.search.best(req.params.n)
        self._apply(state, decision)
        return None

    @staticmethod
    def _complete(state: _Search) -> bool:
        """Every beam has a row, and each still holds the KV it was computed on (one preempted since
        computes it again, and its row comes again)."""
        for i, beam in enumerate(state.beams):
            if i in state.rows and beam.status is not RequestStatus.RUNNING and state.search.generated:
                del state.rows[i]
        return len(state.rows) == len(state.beams)

    def _apply(self, state: _Search, decision: BeamStep) -> None:
        """Move each beam's KV and tokens to the next step's beams."""
        old = state.beams
        keeps: dict[int, int] = {}  # parent slot -> the new slot that keeps its Request
        for i, parent in enumerate(decision.parents):
            keeps.setdefault(parent, i)
        spare = [old[j] for j in range(len(old)) if j not in keeps]
        new: list[Request] = [old[p] if keeps[p] == i else spare.pop() for i, p in enumerate(decision.parents)]
        copies = []
        for i, parent in enumerate(decision.parents):
            if new[i] is not old[parent]:
                copies += self._take_over(new[i], old[parent])
        if copies:
            self.copy_blocks(copies)
        for beam, token in zip(new, decision.tokens):
            beam.append_token(token)
        state.beams = new

    def _take_over(self, beam: Request, parent: Request) -> list[tuple[int, int]]:
        """beam becomes a copy of parent: its tokens, and its KV (shared, the partial block copied)."""
        copy = self.kv.reseat(beam, parent)
        beam.all_token_ids = list(parent.all_token_ids)
        beam.num_output = parent.num_output
        if beam.held_fork:  # the first step: this beam joins the running requests now
            beam.held_fork = False
            self.scheduler.start_running(beam)
        return [] if copy is None else [copy]


def finish_reason(hyp: Hypothesis) -> FinishReason:
    return FinishReason.STOP if hyp.ended_by_end_id else FinishReason.LENGTH


def output_tokens(hyp: Hypothesis) -> list[int]:
    """The hypothesis as the engine reports a sequence: without the end token (TensorRT-LLM's rule)."""
    return list(hyp.tokens[:-1] if hyp.ended_by_end_id else hyp.tokens)

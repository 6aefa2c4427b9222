"""Who drafts what: the per-request draft length, the n-gram drafters, the pause at high concurrency."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from trtprompt.engine.request import FinishReason, Request
from trtprompt.engine.speculation.config import SpeculationConfig
from trtprompt.engine.speculation.ngram import Match, NgramIndex


class DraftModel(Protocol):
    """A smaller engine drafting greedily for the target's requests (draft_model.py)."""

    def propose(self, requests: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Up to k draft tokens for each (request, k), in one batch."""

    def release(self, request: Request) -> None:
        """Forget a finished request (its draft KV)."""


def next_draft_len(current: int, drafted: int, accepted: int, max_draft_len: int) -> int:
    """A request's next draft length from its last verification: every draft accepted doubles it (a run of
    matches tends to go on: a copied passage reaches max_draft_len in a few steps), a rejection halves it, or
    cuts it to the accepted run plus one where that is longer (never below one). Each rejected draft token
    costs verification compute; collapsing at once, or never shrinking, measured worse on copying and on free
    text respectively (docs/speculative-decoding.md, "Draft length")."""
    if accepted == drafted:
        return min(max_draft_len, max(2 * current, 1))
    return max(1, min(current, max(accepted + 1, current // 2)))


@dataclass
class SpecCounters:
    """Totals since the engine started, as vLLM's spec_decode metrics and TensorRT-LLM's
    specDecodingStats count them."""

    num_drafts: int = 0  # verifications of at least one draft token (one per request and step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted


class Drafter:
    """Proposes each generating request's drafts for its next step (Request.draft_token_ids)."""

    def __init__(self, config: SpeculationConfig, draft_model: DraftModel | None = None) -> None:
        self.config = config
        self.draft_model = draft_model
        self.counters = SpecCounters(accepted_per_pos=[0] * config.max_draft_len)
        c = config
        self.pool = NgramIndex(c.max_matching_ngram_size, c.is_keep_all, c.is_use_oldest, c.public_pool_tokens) \
            if c.mode == "ngram" and c.is_public_pool else None

    def paused(self, num_running: int) -> bool:
        """The batch is compute-bound: verifying drafts would cost the others more than it saves."""
        limit = self.config.max_concurrency
        return limit is not None and num_running > limit

    def propose(self, requests: Sequence[Request]) -> None:
        """Set each request's drafts for the step after this one (none where it may take no more)."""
        wanted = [(r, self._budget(r)) for r in requests]
        wanted = [(r, k) for r, k in wanted if k > 0]
        if self.draft_model is not None:
            drafts = self.draft_model.propose(wanted)
        else:
            drafts = [self._ngram(r, k) for r, k in wanted]
        for (req, _), draft in zip(wanted, drafts):
            req.draft_token_ids = draft
            req.drafts_at = req.num_tokens

    def _budget(self, req: Request) -> int:
        """Draft tokens req may verify next: its adaptive length, and never past max_tokens (the token
        after the last accepted draft is an output too)."""
        if req.draft_len is None:
            req.draft_len = self.config.max_draft_len
        return max(0, min(req.draft_len, req.max_output_tokens - req.num_output - 1))

    def _ngram(self, req: Request, k: int) -> list[int]:
        if req.ngram is None:
            c = self.config
            index = NgramIndex(c.max_matching_ngram_size, c.is_keep_all, c.is_use_oldest)
            req.ngram = index, index.add(req.all_token_ids)
        else:
            index, sid = req.ngram
            index.extend(sid)
        best: Match | None = index.propose(req.all_token_ids, k)
        if self.pool is not None:
            shared = self.pool.propose(req.all_token_ids, k, req.cache_salt)
            if shared is not None and (best is None or shared.run > best.run):
                best = shared
        return [] if best is None else best.tokens

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        """Count one verification and adapt req's draft length."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += drafted
        c.num_accepted_tokens += accepted
        for i in range(accepted):
            c.accepted_per_pos[i] += 1
        req.stats.num_draft_tokens += drafted
        req.stats.num_accepted_draft_tokens += accepted
        req.draft_len = next_draft_len(req.draft_len or self.config.max_draft_len, drafted, accepted,
                                       self.config.max_draft_len)

    def admitted(self, req: Request) -> None:
        """A new request's prompt joins the public pool at once (its salt's): requests running side by side
        with the same template or tool definitions draft from each other."""
        if self.pool is not None and req.params.speculative_decoding:
            self.pool.add(list(req.prompt_token_ids), req.cache_salt)

    def finished(self, req: Request) -> None:
        """A finished sequence's output joins the public pool (its salt's), after the prompt's last tokens
        (the runs that lead into it; admitted() added the prompt); the draft model forgets it."""
        req.ngram = None
        if self.pool is not None and req.params.speculative_decoding and req.finish_reason is not FinishReason.ERROR \
                and req.num_output:
            lead = max(req.num_prompt_tokens - self.config.max_matching_ngram_size, 0)
            self.pool.add(req.all_token_ids[lead:], req.cache_salt)
        if self.draft_model is not None:
            self.draft_model.release(req)

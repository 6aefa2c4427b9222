"""Log probabilities as OpenAI's and vLLM's answers show them.

The values are the engine's "raw" ones: log_softmax of the model's logits before temperature,
penalties, logit_bias and masks (vLLM's default; OpenAI does not say). Each token is named by
its id decoded alone (special tokens included) and, for chat, that text's UTF-8 bytes.

- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`
- completions (OpenAI's legacy form): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
  top_logprobs a `{token: logprob}` map of the k most likely and the chosen token (null, as the
  logprob, for an echoed prompt's first token); text_offset: each token's offset into the choice's
  text, counted as the lengths of the tokens' own texts, as vLLM counts it.
- vLLM's `prompt_logprobs`: `[null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]` (rank:
  1 for the most likely; null for a prompt token outside the top k, whose rank the engine does not report).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Candidate:
    token_id: int
    token: str  # the id decoded alone
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One position of an answer: the token there and the most likely ones, most likely first."""

    chosen: Candidate
    top: tuple[Candidate, ...]
    scored: bool = True  # False: an echoed prompt's first token (nothing precedes it: no logprob)


def chat_logprobs(lps: Sequence[TokenLogprob], k: int) -> dict[str, Any]:
    return {"content": [_chat_entry(lp.chosen) | {"top_logprobs": [_chat_entry(c) for c in lp.top[:k]]}
                        for lp in lps]}


def _chat_entry(c: Candidate) -> dict[str, Any]:
    return {"token": c.token, "logprob": c.logprob, "bytes": list(c.token.encode("utf-8"))}


def completion_logprobs(lps: Sequence[TokenLogprob], k: int, offset: int) -> dict[str, Any]:
    """offset: where the first of lps starts in the choice's text (the earlier tokens' lengths)."""
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.chosen.token)
    return {"tokens": [lp.chosen.token for lp in lps],
            "token_logprobs": [lp.chosen.logprob if lp.scored else None for lp in lps],
            "top_logprobs": [_top_map(lp, k) if lp.scored else None for lp in lps],
            "text_offset": offsets}


def _top_map(lp: TokenLogprob, k: int) -> dict[str, float]:
    """The k most likely and the chosen token (OpenAI: "up to logprobs + 1" entries). Tokens whose texts
    are the same (bytes of a split character decode to U+FFFD each) show once, at the most likely's value."""
    top: dict[str, float] = {}
    for c in (*lp.top[:k], lp.chosen):
        top.setdefault(c.token, c.logprob)
    return top


def text_length(lps: Sequence[TokenLogprob]) -> int:
    """How far these tokens move completion_logprobs' text_offset."""
    return sum(len(lp.chosen.token) for lp in lps)


def vllm_prompt_logprobs(lps: Sequence[TokenLogprob], k: int) -> list[dict[str, Any] | None]:
    return [_vllm_position(lp, k) if lp.scored else None for lp in lps]


def _vllm_position(lp: TokenLogprob, k: int) -> dict[str, Any]:
    top = lp.top[:k]
    ranks = {c.token_id: i + 1 for i, c in enumerate(lp.top)}
    out = {str(lp.chosen.token_id): _vllm_entry(lp.chosen, ranks.get(lp.chosen.token_id))}
    for i, c in enumerate(top):
        out.setdefault(str(c.token_id), _vllm_entry(c, i + 1))
    return out


def _vllm_entry(c: Candidate, rank: int | None) -> dict[str, Any]:
    return {"logprob": c.logprob, "rank": rank, "decoded_token": c.token}

"""End conditions of a request: end_id, stop words (trimmed), max_tokens."""

from __future__ import annotations

from trtprompt.engine.request import FinishReason, Request, TokenLogprob


def check_stop(req: Request, token: int, logprob: TokenLogprob | None = None) -> FinishReason | None:
    """Record the sampled token (and its log probability) and say whether the request is done.

    The end token itself is not part of the output (TensorRT-LLM's rule); a stop word is trimmed
    unless the request keeps it (include_stop_in_output).
    """
    if token in req.end_ids and req.num_output >= req.params.min_tokens:
        req.end_logprob = logprob  # kept apart: clients scoring text read it (lm-eval's loglikelihood)
        return FinishReason.STOP
    req.append_token(token, logprob)
    out = req.all_token_ids
    for stop in req.params.stop_token_ids:
        n = len(stop)
        if req.num_output >= n and tuple(out[-n:]) == stop:
            req.stopped_by_word = True
            req.stop_trim = 0 if req.params.include_stop_in_output else n
            return FinishReason.STOP
    if req.num_output >= req.max_output_tokens:
        return FinishReason.LENGTH
    return None


def _pending_stop_prefix(req: Request) -> int:
    """Longest output suffix that could still grow into a stop word."""
    out = req.output_token_ids
    best = 0
    for stop in req.params.stop_token_ids:
        for k in range(min(len(stop) - 1, len(out)), best, -1):
            if tuple(out[-k:]) == stop[:k]:
                best = k
                break
    return best


def visible_output_len(req: Request) -> int:
    """Output tokens a client may see now: a possible stop word is held back until decided."""
    if req.is_finished:
        return req.num_output - req.stop_trim
    return req.num_output - _pending_stop_prefix(req)

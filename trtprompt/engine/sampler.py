"""Turn last-token logits into next tokens: penalties, min_tokens, vocabulary controls (logit bias,
bad words, allowed ids), greedy or seeded sampling (temperature, top-k, top-p, min-p), and the log
probabilities a request asked for.

Each request is sampled inside its own guard: a request whose row cannot be
sampled (its logits are NaN or all -inf, or sampling raises) gets a
SampleFailure in its slot and the rest of the batch gets its tokens
(issue 11: one bad request must not fail the step for everyone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from trtprompt.engine.request import Request, SamplingParams, TokenLogprob


def apply_penalties(row: torch.Tensor, req: Request) -> None:
    """In-place on one logits row.

    repetition_penalty follows Hugging Face (over prompt and output tokens);
    presence and frequency penalties follow OpenAI (over output tokens only).
    """
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=row.device)
        score = row[seen]
        row[seen] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        out = req.output_token_ids
        if out:
            ids = torch.tensor(out, dtype=torch.long, device=row.device)
            counts = torch.bincount(ids, minlength=row.numel()).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def mask_end_tokens(row: torch.Tensor, req: Request) -> None:
    """min_tokens: the end token may not be chosen before that many outputs."""
    if req.num_output < req.params.min_tokens and req.end_ids:
        row[list(req.end_ids)] = float("-inf")


def apply_vocabulary_controls(row: torch.Tensor, req: Request) -> None:
    """In-place on one logits row: logit_bias added, then bad words and ids outside allowed_token_ids
    set to -inf (a bias never revives a banned token)."""
    p = req.params
    bias_ids, bias, allowed = vocabulary_tensors(req, row)
    if bias_ids is not None and bias is not None:
        row[bias_ids] += bias
    if p.bad_words:
        banned = banned_tokens(req.output_token_ids, p.bad_words)
        if banned:
            row[banned] = float("-inf")
    if allowed is not None:
        keep = row[allowed].clone()
        row.fill_(float("-inf"))
        row[allowed] = keep


def vocabulary_tensors(req: Request, row: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """(bias ids, biases, allowed ids) as tensors, made on the request's first step and kept: an
    embedding bias may name the whole vocabulary, too much to rebuild from Python every token."""
    if req.vocabulary is None:
        p = req.params
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=row.device) if p.logit_bias else None
        bias = torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype, device=row.device) if p.logit_bias else None
        allowed = None if p.allowed_token_ids is None else \
            torch.tensor(p.allowed_token_ids, dtype=torch.long, device=row.device)
        req.vocabulary = (ids, bias, allowed)
    return req.vocabulary


def banned_tokens(output: list[int], bad_words: tuple[tuple[int, ...], ...]) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output now (vLLM's rule: the output
    only, not the prompt)."""
    banned = []
    for word in bad_words:
        head = len(word) - 1
        if head == 0 or (len(output) >= head and tuple(output[-head:]) == word[:-1]):
            banned.append(word[-1])
    return banned


def sampling_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from (unnormalized): temperature, then top-k,
    top-p and min-p, in transformers' order of its warpers (the oracle of tests/test_openai_extensions.py)."""
    logits = row / max(params.temperature, 1e-6)
    if params.top_k and params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and 0.0 < params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (always at least one token).
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if params.min_p > 0.0:
        # Relative to the most likely token kept, so it needs no renormalization first; that token stays.
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def sample_row(row: torch.Tensor, req: Request) -> int:
    p = req.params
    if req.generator is None:
        gen = torch.Generator(device=row.device)
        # Sequence i of a request with n > 1 draws from seed + i: its own stream, reproducible.
        gen.manual_seed(((p.seed if p.seed is not None else 0) + req.sequence_index) % 2**64)
        req.generator = gen
    return int(torch.multinomial(sampling_probs(row, p), 1, generator=req.generator).item())


@dataclass(frozen=True)
class SampleFailure:
    """Why one request's row gave no token; the engine finishes that request with this error."""

    reason: str


def unusable_rows(logits: torch.Tensor) -> list[bool]:
    """Rows no token can honestly come from: any NaN, or every logit -inf (the definition;
    greedy_tokens finds the same rows in its one pass, and tests compare the two)."""
    bad = torch.isnan(logits).any(dim=-1) | torch.isneginf(logits).all(dim=-1)
    return bad.tolist()


def kernels_loaded() -> bool:
    """Whether this process has loaded the compiled kernels. Never builds them: an engine on the torch or
    reference attention path has not, and its first step must not wait minutes for a compiler."""
    return hasattr(torch.ops.trtprompt, "greedy_rows")


def greedy_tokens(logits: torch.Tensor, compiled: bool | None = None) -> tuple[list[int], list[bool]]:
    """Each row's argmax and whether the row is unusable, in one pass over [rows, vocab].

    A row's max is NaN when it holds a NaN (max propagates it) and -inf exactly when every
    logit is; its index is the first maximal one, as argmax's. Four passes (isnan, any,
    isneginf, all) plus argmax's became one: 49,152-wide rows make that a step's largest
    cost outside the model at batch 32 (docs/design.md, "Per-step overhead"). The compiled
    kernel's pass (csrc/greedy_rows.cpp) runs where this process has loaded the kernels
    (compiled None: decided here), torch's max(dim=-1) elsewhere: the reference tests compare
    it with.
    """
    if compiled is None:
        compiled = logits.device.type == "cpu" and kernels_loaded()
    if compiled and logits.dtype == torch.float32:
        best, index = torch.ops.trtprompt.greedy_rows(logits.contiguous())
    else:
        best, index = logits.max(dim=-1)
    bad = torch.isnan(best) | torch.isneginf(best)
    return index.tolist(), bad.tolist()


def processes_rows(req: Request) -> bool:
    """True when _prepare_row changes req's rows (a row then depends on the tokens before it)."""
    p = req.params
    return p.has_penalties or bool(p.min_tokens) or p.has_vocabulary_controls


def screen_bans(req: Request) -> list[int] | None:
    """For the greedy head (greedy_head.py): the tokens req's row may not take this step before its argmax is read
    (its end ids while min_tokens masks them, as mask_end_tokens does), or None where the row is read for more than
    that argmax (sampling, beams, penalties, vocabulary controls, a grammar, log probabilities or logits)."""
    p = req.params
    if not p.greedy or p.beam_width != 1 or p.has_penalties or p.has_vocabulary_controls or req.matcher is not None \
            or req.reports_extras:
        return None
    return list(req.end_ids) if req.num_output < p.min_tokens and req.end_ids else []


def argmax_only(req: Request) -> bool:
    """True when nothing but the argmax of req's rows is read, each row as the model gave it (screen_bans, and no
    min_tokens): its drafts verify by one argmax."""
    return not req.params.min_tokens and screen_bans(req) == []


def _prepare_row(row: torch.Tensor, req: Request) -> None:
    if req.params.has_penalties:
        apply_penalties(row, req)
    if req.params.min_tokens:
        mask_end_tokens(row, req)
    if req.params.has_vocabulary_controls:
        apply_vocabulary_controls(row, req)


@dataclass(frozen=True)
class RawLogprobs:
    """log_softmax of the rows whose requests asked for log probabilities, taken before any processing."""

    rows: list[int]  # index into the step's requests
    values: torch.Tensor  # [len(rows), vocab]


def raw_logprobs(logits: torch.Tensor, reqs: Sequence[Request]) -> RawLogprobs | None:
    """One log_softmax over every row that wants log probabilities (None when no row does)."""
    rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if not rows:
        return None
    picked = logits if len(rows) == len(reqs) else logits[rows]
    return RawLogprobs(rows, torch.log_softmax(picked.float(), dim=-1))


def logprob_entries(values: torch.Tensor, chosen: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """TokenLogprob per row of values [R, vocab] (log probabilities) for its chosen token, with its
    ks[r] most likely: one gather and one topk for all rows, one transfer to Python."""
    index = torch.tensor(chosen, dtype=torch.long, device=values.device).unsqueeze(1)
    picked = values.gather(1, index).squeeze(1).tolist()
    k_max = max(ks, default=0)
    tops: list[list[float]] = []
    ids: list[list[int]] = []
    if k_max:
        top = torch.topk(values, k_max, dim=-1)
        tops, ids = top.values.tolist(), top.indices.tolist()
    return [TokenLogprob(t, picked[r], tuple(zip(ids[r][:k], tops[r][:k])) if k else ())
            for r, (t, k) in enumerate(zip(chosen, ks))]


def attach_logprobs(raw: RawLogprobs | None, reqs: Sequence[Request],
                    tokens: Sequence[int | SampleFailure]) -> list[TokenLogprob | None]:
    """Each request's TokenLogprob for the token it got this step (None: not asked for, or no token)."""
    out: list[TokenLogprob | None] = [None] * len(reqs)
    if raw is None:
        return out
    kept = [(j, i) for j, i in enumerate(raw.rows) if not isinstance(tokens[i], SampleFailure)]
    if not kept:
        return out
    values = raw.values[[j for j, _ in kept]] if len(kept) != len(raw.rows) else raw.values
    chosen = [int(tokens[i]) for _, i in kept]  # type: ignore[arg-type]  # failures are filtered out above
    entries = logprob_entries(values, chosen, [reqs[i].params.logprobs or 0 for _, i in kept])
    for (_, i), entry in zip(kept, entries):
        out[i] = entry
    return out


def sample(logits: torch.Tensor, reqs: Sequence[Request]) -> list[int | SampleFailure]:
    """logits: [len(reqs), vocab] float32, one row per request that samples this step.

    Returns one token per request, or a SampleFailure for a request whose row failed.
    """
    failures: dict[int, SampleFailure] = {}
    for i, req in enumerate(reqs):
        try:
            _prepare_row(logits[i], req)
        except Exception as exc:  # noqa: BLE001 - fails this request only
            failures[i] = SampleFailure(f"{type(exc).__name__}: {exc}")
    greedy, unusable = greedy_tokens(logits)
    for i, bad in enumerate(unusable):
        if bad and i not in failures:
            failures[i] = SampleFailure("its logits are NaN or all -inf")
    tokens: list[int | SampleFailure] = list(greedy)
    for i, req in enumerate(reqs):
        if i in failures:
            tokens[i] = failures[i]
        elif not req.params.greedy:
            try:
                tokens[i] = sample_row(logits[i], req)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                tokens[i] = SampleFailure(f"{type(exc).__name__}: {exc}")
    return tokens

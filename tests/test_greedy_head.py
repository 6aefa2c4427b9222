"""The greedy head (engine/greedy_head.py): its screen keeps every token that can be the float head's argmax, the
compiled screen_rows equals its torch reference, and an engine answers alike with it and without it, using it only
in steps whose rows are read for their argmax alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trtprompt.engine.engine import LLMEngine
from trtprompt.engine.greedy_head import GROUP, GreedyHead, reference_logits
from trtprompt.engine.panel_linear import panel_width
from trtprompt.engine.quant_w8a8 import dequantize_int8, quantize_int8_groups
from trtprompt.engine.request import SamplingParams

needs_panels = pytest.mark.skipif(panel_width() is None, reason="the panel kernel does not run here")


def _weight(vocab: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of different scales with a few large entries each, so that int8 groups round coarsely."""
    w = torch.randn(vocab, hidden, generator=gen) * (0.02 + torch.rand(vocab, 1, generator=gen))
    spikes = torch.randint(0, hidden, (vocab, 2), generator=gen)
    return w.scatter_add(1, spikes, torch.randn(vocab, 2, generator=gen) * 4).contiguous()


def _head(w: torch.Tensor) -> GreedyHead:
    head = GreedyHead.of(w)
    assert head is not None
    return head


def _check(head: GreedyHead, x: torch.Tensor) -> torch.Tensor:
    """The screened rows against the float head's: same argmax, the same values where kept; returns what is kept."""
    full = x @ head.weight.T
    got = head.logits(x, [[]] * x.shape[0])
    assert got is not None
    kept = torch.isfinite(got)
    assert torch.equal(kept, torch.isfinite(reference_logits(head, x)))
    assert kept.gather(1, full.argmax(dim=-1, keepdim=True)).all(), "a row's float argmax was screened out"
    torch.testing.assert_close(got[kept], full[kept], rtol=1e-5, atol=1e-4)
    assert torch.equal(got.argmax(dim=-1), full.argmax(dim=-1))
    return kept


@needs_panels
@pytest.mark.parametrize("seed", range(4))
def test_the_float_argmax_is_always_kept_and_few_others(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    head = _head(_weight(4096, 256, gen))
    # Hidden states near a token's row, as a trained head's are: one clear winner, a few close ones.
    targets = torch.randint(0, 4096, (head.rows_max,), generator=gen)
    x = head.weight[targets] * 2 + torch.randn(head.rows_max, 256, generator=gen) * 0.5
    kept = _check(head, x)
    assert (kept.sum(dim=-1) < 64).all(), kept.sum(dim=-1)
    _check(head, torch.randn(3, 256, generator=gen) * 5)  # flat rows: many kept, the argmax still among them


@needs_panels
def test_the_bound_holds_where_rounding_errors_add_up() -> None:
    """Weights just short of a rounding half-step (each group's first entry its largest, 1) round with errors of
    almost half a scale, and x whose signs follow a row's errors makes that row's screen miss by their whole sum:
    within the bound, and by more than 0.95 of its rounding half (no tighter bound would hold)."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.randint(-126, 126, (2048, 256), generator=gen) + 0.499) / 127
    w[:, ::GROUP] = 1.0
    w = w * (0.02 + torch.rand(2048, 1, generator=gen))
    head = _head(w)
    q, scale = quantize_int8_groups(w, GROUP)
    errors = w - dequantize_int8(q, scale, torch.float32)
    rows = torch.randint(0, 2048, (head.rows_max,), generator=gen)
    x = torch.sign(errors[rows]) * (0.5 + torch.rand(head.rows_max, 256, generator=gen))
    missed = (x @ w.T - head.screen(x)).abs()
    allowed = x.abs().sum(dim=-1, keepdim=True) * head.bound
    assert (missed <= allowed).all()
    half = x.abs().sum(dim=-1) * scale.amax(dim=1)[rows] * 0.5
    assert (missed.gather(1, rows[:, None]).squeeze(1) > 0.95 * half).all()


@needs_panels
def test_near_ties_keep_both_tokens() -> None:
    gen = torch.Generator().manual_seed(7)
    w = _weight(1024, 128, gen)
    w[5] = w[900] + torch.randn(128, generator=gen) * 1e-6
    head = _head(w)
    kept = _check(head, w[900:901] * 3)
    assert kept[0, 5] and kept[0, 900]


@needs_panels
def test_banned_tokens_leave_the_race_to_the_best_of_the_rest() -> None:
    """min_tokens' end ids (sampler.screen_bans): a banned argmax is -inf and the best allowed token is kept, as the
    float row masked afterwards would choose."""
    gen = torch.Generator().manual_seed(11)
    head = _head(_weight(2048, 128, gen))
    x = head.weight[[40, 41, 42]] * 3
    bans = [[40], [], [42, 7]]
    full = x @ head.weight.T
    for row, ids in zip(full, bans):
        row[ids] = float("-inf")
    got = head.logits(x, bans)
    assert got is not None
    assert torch.equal(torch.isfinite(got), torch.isfinite(reference_logits(head, x, bans)))
    assert got[0, 40] == got[2, 42] == got[2, 7] == float("-inf")
    assert torch.equal(got.argmax(dim=-1), full.argmax(dim=-1))


@needs_panels
def test_rows_past_rows_max_and_non_finite_rows_run_the_float_head() -> None:
    head = _head(_weight(512, 64, torch.Generator().manual_seed(1)))
    assert head.logits(torch.randn(head.rows_max + 1, 64), [[]] * (head.rows_max + 1)) is None
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    assert head.logits(x, [[], []]) is None
    x[1, 3] = float("inf")
    assert head.logits(x, [[], []]) is None


def test_no_screen_where_it_cannot_run() -> None:
    assert GreedyHead.of(torch.randn(512, 64).to(torch.bfloat16)) is None
    assert GreedyHead.of(torch.randn(512, 48)) is None  # 48 columns: not whole groups of 32
    assert GreedyHead.of(torch.randn(501, 64)) is None  # 501 rows: not whole panels


def _generate(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    logprobs: dict[str, list[Any]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(out.logprobs or [])
    return {"tokens": tokens, "logprobs": logprobs}


@needs_panels
def test_engine_answers_alike_and_screens_only_argmax_steps(tiny_engine_dir: Path) -> None:
    engine = LLMEngine.from_engine_dir(tiny_engine_dir, enable_kv_cache_reuse=False, speculative_decoding="none")
    try:
        model = engine.runner.model
        head = model.greedy_head
        assert head is not None
        calls: list[int] = []
        screen = head.logits

        def counted(x: torch.Tensor, bans: list[list[int]]) -> torch.Tensor | None:
            calls.append(x.shape[0])
            return screen(x, bans)

        head.logits = counted  # type: ignore[method-assign]  # counts, then runs the real screen
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        asks = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
        plain = {f"g{i}": ([3 + i, 40, 7 * i + 1, 90], greedy) for i in range(3)}
        with_head = _generate(engine, plain)
        assert calls and max(calls) == 3  # each step's three rows went through the screen
        calls.clear()
        mixed = _generate(engine, {"g": ([5, 6, 7], greedy), "lp": ([5, 6, 8], asks)})
        assert calls == []  # a row whose log probabilities are asked for needs every logit
        # min_tokens: the end id is banned while it masks it, here the token greedy decoding takes third.
        third = with_head["tokens"]["g0"][2]
        held = {"m": ([3, 40, 1, 90], SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, end_id=third))}
        calls.clear()
        banned = _generate(engine, held)
        assert len(calls) == 8 and banned["tokens"]["m"][2] != third
        model.greedy_head = None
        assert _generate(engine, plain) == with_head
        assert _generate(engine, {"g": ([5, 6, 7], greedy), "lp": ([5, 6, 8], asks)}) == mixed
        assert _generate(engine, held) == banned
    finally:
        engine.close()


def test_step_overhead_refuses_to_compare_an_engine_without_a_greedy_head(tiny_engine_dir: Path) -> None:
    """(tests/test_decode_layers.py compares both ways where there is one.)"""
    from trtprompt.bench.scenarios.step_overhead import head_ab

    engine = LLMEngine.from_engine_dir(tiny_engine_dir, enable_kv_cache_reuse=False, speculative_decoding="none")
    try:
        engine.runner.model.greedy_head = None
        with pytest.raises(ValueError, match="--compare-head: this engine has no greedy head"):
            head_ab(engine, rounds=1)
    finally:
        engine.close()

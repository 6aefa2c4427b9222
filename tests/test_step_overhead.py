"""The per-step fast paths against their definitions (docs/design.md, "Per-step overhead")."""

from __future__ import annotations

import torch

from trtprompt.engine.layer_ops import TorchOps
from trtprompt.engine.sampler import greedy_tokens, unusable_rows


def test_greedy_tokens_is_argmax_and_the_unusable_rows_in_one_pass() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(12, 4000, generator=gen) * 3).round()  # rounded: many tied maxima
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, :5] = float("nan")
    logits[4, 9] = float("inf")
    logits[5] = 0.0  # every logit tied: the first index
    logits[6, 100:] = float("-inf")
    tokens, bad = greedy_tokens(logits)
    assert bad == unusable_rows(logits)
    assert bad[1] and bad[2] and bad[3] and sum(bad) == 3
    usable = [i for i, b in enumerate(bad) if not b]
    assert [tokens[i] for i in usable] == torch.argmax(logits[usable], dim=-1).tolist()
    assert tokens[5] == 0 and tokens[4] == 9


def test_torch_rotary_tables_are_the_step_tables_unchanged() -> None:
    cos, sin = torch.rand(5, 1, 32), torch.rand(5, 1, 32)
    tc, ts = TorchOps().rotary_tables(cos, sin)
    assert tc is cos and ts is sin

"""The per-step fast paths against their definitions (docs/design.md, "Per-step overhead")."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from trtprompt.engine import kernels
from trtprompt.engine.layer_ops import TorchOps
from trtprompt.engine.sampler import greedy_tokens, unusable_rows

PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(not kernels.compiled_kernel_status()[0],
                                                             reason="compiled kernels unavailable"))]


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("vocab", [4000, 49152, 8192 * 3 + 5])  # one chunk of the kernel, six, four with a tail
def test_greedy_tokens_is_argmax_and_the_unusable_rows_in_one_pass(compiled: bool, vocab: int) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(13, vocab, generator=gen) * 3).round()  # rounded: many tied maxima
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, :5] = float("nan")
    logits[4, 9] = float("inf")
    logits[5] = 0.0  # every logit tied: the first index
    logits[6, 100:] = float("-inf")
    logits[7, vocab - 1] = 50.0  # the maximum in the last element (the kernel's scalar tail where there is one)
    logits[8, vocab - 1] = float("nan")  # a NaN only in the last element
    logits[12, min(8193, vocab - 2)] = logits[12, 3] = 40.0  # a tie (across the kernel's chunks where 2+): the first
    tokens, bad = greedy_tokens(logits, compiled)
    assert bad == unusable_rows(logits)
    assert bad[1] and bad[2] and bad[3] and bad[8] and sum(bad) == 4
    usable = [i for i, b in enumerate(bad) if not b]
    assert [tokens[i] for i in usable] == torch.argmax(logits[usable], dim=-1).tolist()
    assert tokens[5] == 0 and tokens[4] == 9 and tokens[7] == vocab - 1 and tokens[12] == 3


def test_greedy_tokens_take_the_kernel_only_once_it_is_loaded() -> None:
    code = ("import torch; from trtprompt.engine import sampler, kernels; before = sampler.kernels_loaded(); "
            "sampler.greedy_tokens(torch.zeros(2, 8)); still = sampler.kernels_loaded(); "
            "print(before, still, kernels.compiled_kernel_status()[0] and sampler.kernels_loaded())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    # Sampling built nothing; loading the kernels (the engine's attention and linears do) makes it available.
    assert out.stdout.split() == ["False", "False", str(kernels.compiled_kernel_status()[0])]


def test_torch_rotary_tables_are_the_step_tables_unchanged() -> None:
    cos, sin = torch.rand(5, 1, 32), torch.rand(5, 1, 32)
    tc, ts = TorchOps().rotary_tables(cos, sin)
    assert tc is cos and ts is sin

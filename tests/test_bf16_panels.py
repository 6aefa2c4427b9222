"""bf16 panels (csrc/bf16_panels.cpp): bfloat16 weights packed in input-column pairs, multiplied on avx512_bf16's
dot product, against float32 math on the same bf16 values; the layout; the input checks; and where make_linear puts
them (every call of a bf16 layer linear and lm_head, and a weight-only linear's bf16 copy) and where it does not.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtprompt.engine import isa, kernels
from trtprompt.engine.amx_linear import amx_available
from trtprompt.engine.linear import DenseFewRowsLinear, OneDnnLinear, linear_summary, make_linear, onednn_available
from trtprompt.engine.panel_linear import PanelLinear, bf16_panels_fit, pack_bf16_pairs

PANEL = 32  # output columns per bf16 panel (the AVX-512 variant's panel width)
# Every register block size (up to 12 rows), uneven splits, several groups of blocks (8 blocks of 12 rows each).
ROWS = [*range(1, 14), 25, 32, 64, 200]

needs_bf16_panels = pytest.mark.skipif(
    not kernels.compiled_kernel_status()[0] or not bf16_panels_fit(torch.zeros(PANEL, 2, dtype=torch.bfloat16)),
    reason="no bf16 panels here (the AVX-512 kernel build and a CPU with avx512_bf16)")


def _bf16(*shape: int, seed: int, scale: float = 0.05) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within the bf16 output's rounding (2^-8 of a value) and float32 sums taken in another order."""
    return torch.allclose(got.float(), want, rtol=2 ** -8, atol=1e-4 * want.abs().max().item())


def test_pack_bf16_pairs_layout() -> None:
    w = torch.arange(64 * 6, dtype=torch.float32).view(64, 6).bfloat16()
    pairs = pack_bf16_pairs(w, PANEL)
    assert pairs.shape == (2, 3, PANEL, 2)
    for p, j, c, e in ((0, 0, 0, 0), (0, 0, 0, 1), (1, 2, 31, 1), (1, 1, 5, 0)):
        assert pairs[p, j, c, e] == w[p * PANEL + c, 2 * j + e]


@needs_bf16_panels
@pytest.mark.parametrize("k", [2, 96, 576, 2050])  # 2,050: past one chunk of K (1,024 pairs), an uneven last chunk
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_panels_match_float32_math_for_every_row_count(k: int, bias: bool) -> None:
    w = _bf16(2 * PANEL, k, seed=k)
    b = torch.randn(2 * PANEL, generator=torch.Generator().manual_seed(1)) if bias else None
    pairs = pack_bf16_pairs(w, PANEL)
    for m in ROWS:
        x = _bf16(m, k, seed=m, scale=1.0)
        y = torch.ops.trtprompt.panel_linear(x, pairs, None, b)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 2 * PANEL)
        assert _close(y, F.linear(x.float(), w.float(), b)), (k, m)


@needs_bf16_panels
def test_bf16_panels_refuse_what_they_cannot_read() -> None:
    pairs = pack_bf16_pairs(_bf16(PANEL, 64, seed=3), PANEL)
    x = _bf16(4, 64, seed=4)
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        torch.ops.trtprompt.panel_linear(x.float(), pairs, None, None)
    with pytest.raises(RuntimeError, match="no scale"):
        torch.ops.trtprompt.panel_linear(x, pairs, torch.ones(PANEL), None)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.trtprompt.panel_linear(_bf16(4, 62, seed=5), pairs, None, None)
    with pytest.raises(RuntimeError, match=r"\[N / 32, K / 2, 32, 2\]"):
        torch.ops.trtprompt.panel_linear(x, pairs.reshape(1, 32, 64), None, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.trtprompt.panel_linear(x, pairs, None, torch.ones(PANEL, dtype=torch.bfloat16))


@needs_bf16_panels
def test_bf16_layer_linears_and_lm_head_run_every_call_on_bf16_panels() -> None:
    if amx_available(torch.bfloat16, torch.device("cpu"), 2 * PANEL, 96):
        pytest.skip("AMX runs bf16 linears here (amx_linear.py comes first)")
    w, b = _bf16(2 * PANEL, 96, seed=6), _bf16(2 * PANEL, seed=7)
    layer = make_linear(w, b, "onednn", torch.bfloat16)
    head = make_linear(w, b, "onednn", torch.bfloat16, few_rows=False)
    assert isinstance(layer, PanelLinear) and isinstance(head, PanelLinear) and layer.dense is None
    pairs = pack_bf16_pairs(w, PANEL)
    for m in (1, 4, 5, 64, 300):
        x = _bf16(m, 96, seed=m, scale=1.0)
        kernel = torch.ops.trtprompt.panel_linear(x, pairs, None, b.float())
        assert torch.equal(layer(x), kernel) and torch.equal(head(x), kernel), m
    assert layer(_bf16(2, 3, 96, seed=8)).shape == (2, 3, 2 * PANEL)  # leading dimensions kept
    assert "121 x panel kernel on bf16 dot products" in linear_summary([layer] * 121, torch.bfloat16)


def test_bf16_weights_off_the_panels_keep_the_few_rows_kernel_and_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernels.compiled_kernel_status()[0] or not onednn_available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no compiled kernels or no oneDNN bf16 here")
    if amx_available(torch.bfloat16, torch.device("cpu"), 2 * PANEL, 96):
        pytest.skip("AMX runs bf16 linears here (amx_linear.py comes first)")
    odd_k = _bf16(2 * PANEL, 97, seed=9)  # K odd: no pairs
    assert not bf16_panels_fit(odd_k) and not isinstance(make_linear(odd_k, None, "onednn", torch.bfloat16),
                                                         PanelLinear)
    assert not bf16_panels_fit(_bf16(2 * PANEL, 96, seed=10).float())  # float32 weights: the float32 panels
    no_bf16 = frozenset(isa.cpu_flags() - {"avx512_bf16"})
    monkeypatch.setattr(isa, "cpu_flags", lambda: no_bf16)
    w = _bf16(2 * PANEL, 96, seed=11)
    assert not bf16_panels_fit(w)
    assert isinstance(make_linear(w, None, "onednn", torch.bfloat16), DenseFewRowsLinear)
    assert type(make_linear(w, None, "onednn", torch.bfloat16, few_rows=False)) is OneDnnLinear

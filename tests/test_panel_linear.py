"""The panel linear kernel (csrc/panel_linear.cpp) and the linears on it, against plain torch.

float32 and int8 + row scale panels at every row count of a register block and past it, with float32 and
bfloat16 activations, K in several chunks; the packed layout; its input checks; then the float32 layer linear
and lm_head, and the int8 weight-only linear, each bit-identical on both sides of its row bounds to the path
that should run there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtprompt.engine import isa, kernels
from trtprompt.engine.amx_linear import amx_available
from trtprompt.engine.linear import (
    BF16_COPY_ROWS_MIN,
    FEW_ROWS_MAX,
    OneDnnLinear,
    WeightOnlyLinear,
    bf16_dot_copy,
    bf16_linear,
    dequantize,
    linear_summary,
    make_linear,
    onednn_available,
)
from trtprompt.engine.panel_linear import (
    PANEL_INT8_ROWS,
    PANEL_ROWS,
    PanelLinear,
    PanelRows,
    bf16_panels_fit,
    pack_panels,
    panel_rows,
    panel_width,
)
from trtprompt.engine.quant_w8a8 import quantize_int8, quantize_int8_groups

pytestmark = pytest.mark.skipif(not kernels.compiled_kernel_status()[0], reason="compiled kernels unavailable")

# Every block size of both variants (AVX2 blocks of up to 6 rows, AVX-512 of up to 12), uneven splits, 64.
ROWS = [*range(1, 14), 25, 64]


def _width() -> int:
    return int(torch.ops.trtprompt.panel_width())


def _weight(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(stored weight, its int8 scale or None, the float weight it stands for)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt == "float32":
        return w, None, w
    q, s = quantize_int8(w)
    return q, s, dequantize(q, s, torch.float32)


def test_pack_panels_layout() -> None:
    w = torch.arange(6 * 5, dtype=torch.float32).view(6, 5)
    panels = pack_panels(w, 3)
    assert panels.shape == (2, 5, 3)
    for p in range(2):
        for k in range(5):
            for c in range(3):
                assert panels[p, k, c] == w[p * 3 + c, k]


@pytest.mark.parametrize("fmt", ["float32", "int8"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_panel_kernel_matches_torch_for_every_row_count(fmt: str, x_dtype: torch.dtype) -> None:
    n, k = 3 * _width(), 600  # three panels; K in chunks of 256, 256 and 88
    stored, scale, w = _weight(fmt, n, k, seed=1)
    panels, bias = pack_panels(stored, _width()), torch.randn(n)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(x_dtype)
        for b in (None, bias):
            got = torch.ops.trtprompt.panel_linear(x, panels, scale, b)
            want = x.float() @ w.t() + (0 if b is None else b)
            assert got.dtype == x_dtype and got.shape == (m, n)
            tol = 1e-5 if x_dtype == torch.float32 else 8e-3  # a bfloat16 output is rounded once
            assert torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item()), (fmt, m)
    assert torch.ops.trtprompt.panel_linear(torch.zeros(0, k), panels, scale, None).shape == (0, n)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
@pytest.mark.parametrize("k", [3, 4, 7, 603])
def test_one_row_sums_every_column_whatever_k_leaves_after_its_four_chains(fmt: str, k: int) -> None:
    """One row takes a panel's K whole in four interleaved chains of sums and the columns past a multiple of four
    alone (csrc/panel_linear.cpp, one_row_sums)."""
    n = 2 * _width()
    stored, scale, w = _weight(fmt, n, k, seed=k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3))
    got = torch.ops.trtprompt.panel_linear(x, pack_panels(stored, _width()), scale, None)
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_grouped_int8_rows_are_equal_bit_for_bit_on_both_sides_of_the_widening_bound(group: int) -> None:
    """From a dozen rows the kernel widens a grouped chunk to float32 once for all its blocks instead of in every
    block (csrc/panel_linear.cpp, kWidenRows): a row's sums are the same floats in the same order either way."""
    n, k = 3 * _width(), 640  # K in chunks of 256, 256 and 128: whole groups
    q, scale = quantize_int8_groups(torch.randn(n, k, generator=torch.Generator().manual_seed(group)), group)
    panels, packed_scale = pack_panels(q, _width()), pack_panels(scale.float(), _width())
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(7))
    many = torch.ops.trtprompt.panel_linear(x, panels, packed_scale, None)
    for m in (2, 5, 11):
        assert torch.equal(torch.ops.trtprompt.panel_linear(x[:m].contiguous(), panels, packed_scale, None),
                           many[:m]), m
    torch.testing.assert_close(many, x @ dequantize(q, scale, torch.float32).t(), rtol=1e-5, atol=1e-4)


def test_panel_kernel_refuses_what_it_cannot_read() -> None:
    width = _width()
    w, q, s = torch.randn(width, 32), torch.zeros(width, 32, dtype=torch.int8), torch.ones(width)
    x = torch.randn(2, 32)
    cases = [(x, pack_panels(w, width)[:, :16], None, "columns"),
             (x, w.view(1, 32, width)[:, :, : width // 2].contiguous(), None, "panels"),
             (x, pack_panels(q, width), None, "needs its scale"),
             (x, pack_panels(w, width), s, "needs its scale"),
             (x, pack_panels(q, width), torch.ones(width + 1), "a scale per output column must be"),
             (x, pack_panels(q, width), torch.ones(1, 8, width), "must be 32, 64 or 128"),  # G 4
             (x, pack_panels(q, width), torch.ones(2, 1, width), "grouped scales must be panels"),
             (x.half(), pack_panels(w, width), None, "float32 or bfloat16")]
    for xs, panels, scale, words in cases:
        with pytest.raises(RuntimeError, match=words):
            torch.ops.trtprompt.panel_linear(xs, panels, scale, None)


needs_panels = pytest.mark.skipif(panel_width() is None or not onednn_available(torch.float32, torch.device("cpu")),
                                  reason="the panel kernel is not used in this kernel variant")


@needs_panels
def test_float32_linears_run_their_variants_rows_on_panels_and_larger_calls_on_onednn() -> None:
    width, rows = panel_width(), panel_rows()
    assert width is not None and rows is not None
    gen = torch.Generator().manual_seed(2)
    w, bias = torch.randn(2 * width, 96, generator=gen) * 0.05, torch.randn(2 * width, generator=gen)
    layer, head = make_linear(w, bias, "onednn", torch.float32), make_linear(w, bias, "onednn", torch.float32,
                                                                              few_rows=False)
    assert isinstance(layer, PanelLinear) and layer.rows_max == rows.layer_max
    assert (layer.dense is None) == (rows.layer_max is None)
    assert isinstance(head, PanelLinear) and head.rows_max == rows.head_max
    dense = OneDnnLinear(w, bias)
    layer_bounds = set() if rows.layer_max is None else {rows.layer_max, rows.layer_max + 1}
    for m in sorted({1, rows.head_max, rows.head_max + 1, 300} | layer_bounds):
        x = torch.randn(m, 96, generator=gen)
        kernel = torch.ops.trtprompt.panel_linear(x, pack_panels(w, width), None, bias)
        on_panels = rows.layer_max is None or m <= rows.layer_max
        assert torch.equal(layer(x), kernel if on_panels else dense(x)), m
        assert torch.equal(head(x), kernel if m <= rows.head_max else dense(x)), m
        want = F.linear(x, w, bias)
        assert torch.allclose(layer(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), m
    assert layer(torch.randn(2, 3, 96)).shape == (2, 3, 2 * width)  # leading dimensions kept
    if onednn_available(torch.bfloat16, torch.device("cpu")):  # bf16 weights: only on bf16 panels (test_bf16_panels)
        on_bf16 = make_linear(w.bfloat16(), None, "onednn", torch.bfloat16)
        assert isinstance(on_bf16, PanelLinear) == bf16_panels_fit(w.bfloat16())
    assert not isinstance(make_linear(w[:-1], None, "onednn", torch.float32), PanelLinear)  # not whole panels
    with pytest.raises(ValueError, match="rows_max"):
        PanelLinear(w, None, width, dense)


@needs_panels
def test_int8_weight_only_runs_panels_for_its_rows() -> None:
    width = panel_width()
    assert width is not None
    q, s = quantize_int8(torch.randn(2 * width, 64, generator=torch.Generator().manual_seed(3)) * 0.05)
    bias = torch.randn(2 * width)
    linear = make_linear(q, bias, "onednn", torch.float32, s)
    assert isinstance(linear, WeightOnlyLinear) and linear.panels is not None
    w = dequantize(q, s, torch.float32)
    for m in (1, PANEL_INT8_ROWS.start, FEW_ROWS_MAX, PANEL_INT8_ROWS.stop - 1, PANEL_INT8_ROWS.stop):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        if m in PANEL_INT8_ROWS:
            path = torch.ops.trtprompt.panel_linear(x, pack_panels(q, width), s, bias)
        elif m <= FEW_ROWS_MAX:
            path = torch.ops.trtprompt.few_rows_linear(x, q, s, 0) + bias
        else:
            path = torch.nn.functional.linear(x, w, bias)
        assert torch.equal(linear(x), path), m
    summary = linear_summary([linear, make_linear(w, None, "onednn", torch.float32)], torch.float32)
    rows = panel_rows()
    assert rows is not None
    plain = "1 x panel kernel" if rows.layer_max is None else f"1 x oneDNN prepacked (panel kernel <= {rows.layer_max}"
    assert "panel kernel for 2-256 rows" in summary and plain in summary
    assert "MiB of weight copies" in summary


@pytest.mark.parametrize("b,t", [(1, 1), (2, 3), (3, 100)])  # int8: the few-rows kernel, panels, dense above 256
def test_linears_fold_leading_dims_into_rows(b: int, t: int) -> None:
    """[B, T, in] gives what [B * T, in] gives, in [B, T, out] (on_rows); the model itself passes 2-D rows."""
    w, _, _ = _weight("float32", 2 * _width(), 64, 11)
    q, s, _ = _weight("int8", 2 * _width(), 64, 12)
    x = torch.randn(b, t, 64, generator=torch.Generator().manual_seed(t))
    for lin in (PanelLinear(w, None, _width()), WeightOnlyLinear(q, s, None, torch.float32)):
        got = lin(x)
        assert got.shape == (b, t, 2 * _width())
        assert torch.equal(got, lin(x.reshape(b * t, 64)).view(b, t, -1))


def test_panel_rows_bounds_are_checked_and_every_variant_names_a_kernel_variant() -> None:
    assert set(PANEL_ROWS) <= set(isa.BY_NAME)
    with pytest.raises(ValueError, match="layer_max"):
        PanelRows(0, 8, 4)
    with pytest.raises(ValueError, match="head_max"):
        PanelRows(None, 0, 4)
    with pytest.raises(ValueError, match="screen_max"):
        PanelRows(None, 8, 0)


@pytest.mark.parametrize("kind", ["int8", "int8_groups"])
def test_bf16_weight_only_runs_a_bf16_copy_from_its_rows_where_the_cpu_has_bf16_dots(kind: str) -> None:
    gen = torch.Generator().manual_seed(21)
    w, bias = torch.randn(2 * _width(), 64, generator=gen) * 0.05, torch.randn(2 * _width(), generator=gen)
    q, s = quantize_int8(w) if kind == "int8" else quantize_int8_groups(w, 32)
    assert make_linear(q, bias, "onednn", torch.float32, s).bf16_copy is None  # float32 activations: never
    if not bf16_dot_copy(torch.bfloat16, torch.device("cpu")) or amx_available(torch.bfloat16, torch.device("cpu"),
                                                                                   *w.shape):
        pytest.skip("no avx512_bf16 without AMX here: the weight-only linear keeps no bf16 copy")
    linear = make_linear(q, bias.bfloat16(), "onednn", torch.bfloat16, s)
    assert isinstance(linear, WeightOnlyLinear) and linear.bf16_copy is not None
    copy = bf16_linear(dequantize(q, s, torch.bfloat16), bias.bfloat16())  # bf16 panels where they run, else oneDNN
    assert type(linear.bf16_copy) is type(copy)
    held = linear.bf16_copy.panels if isinstance(linear.bf16_copy, PanelLinear) else linear.bf16_copy.packed
    for m in (1, BF16_COPY_ROWS_MIN - 1, BF16_COPY_ROWS_MIN, 32, 300):
        x = torch.randn(m, 64, generator=gen).bfloat16()
        call = linear.kernel_call(m)
        assert (call is not None and call.weight is held) == (m >= BF16_COPY_ROWS_MIN), m
        if m >= BF16_COPY_ROWS_MIN:
            assert torch.equal(linear(x), copy(x)), m
        else:
            want = F.linear(x.float(), dequantize(q, s, torch.float32), bias.bfloat16().float())
            assert torch.allclose(linear(x).float(), want, rtol=2e-2, atol=2e-2), m
    summary = linear_summary([linear], torch.bfloat16)
    what = "bf16 panels" if isinstance(copy, PanelLinear) else "oneDNN bf16"
    assert f"a bf16 copy from {BF16_COPY_ROWS_MIN} ({what})" in summary and "MiB of weight copies" in summary

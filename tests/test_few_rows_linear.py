"""The few-rows linear kernel (csrc/few_rows_linear.cpp) and the weight-only linears on it, against plain torch.

Each weight format (float32, bfloat16, int8 + row scale, int4 in groups) at every row count a pass holds
(1-8) and past it (9, 17: two and three passes), with float32 and bfloat16 activations; then
WeightOnlyLinear on both sides of FEW_ROWS_MAX (kernel vs dequantize + dense GEMM), and a dense linear on both
sides of DENSE_FEW_ROWS_MAX (kernel vs oneDNN).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtprompt.engine import kernels
from trtprompt.engine.linear import (DENSE_FEW_ROWS_MAX, FEW_ROWS_MAX, DenseFewRowsLinear, OneDnnLinear,
                                     WeightOnlyLinear, dequantize, few_rows_available, make_linear, onednn_available)
from trtprompt.engine.quant_int4 import dequantize_int4, quantize_int4
from trtprompt.engine.quant_w8a8 import quantize_int8

pytestmark = pytest.mark.skipif(not kernels.compiled_kernel_status()[0], reason="compiled kernels unavailable")

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17]


def _weights(n: int, k: int, group: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, int]]:
    """Each format: (stored weight, scale, group) and, implicitly, the float weight it stands for."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    q8, s8 = quantize_int8(w)
    q4, s4 = quantize_int4(w, group)
    return {"float32": (w, None, 0), "bfloat16": (w.bfloat16(), None, 0), "int8": (q8, s8, 0), "int4": (q4, s4, group)}


def _float_weight(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return stored.float() if scale is None else dequantize(stored, scale, torch.float32)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch_for_every_row_count(fmt: str, x_dtype: torch.dtype) -> None:
    n, k = 37, 128  # 37 rows of W: neither the task size (16) nor 4 rows at once divide it
    stored, scale, group = _weights(n, k, 64, seed=1)[fmt]
    w = _float_weight(stored, scale)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(x_dtype)
        got = torch.ops.trtprompt.few_rows_linear(x, stored, scale, group)
        want = x.float() @ w.t()
        assert got.dtype == x_dtype and got.shape == (m, n)
        # float32 sums in another order; a bfloat16 output is rounded once (8 bits of mantissa)
        tol = 1e-5 if x_dtype == torch.float32 else 8e-3
        assert torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item()), (fmt, m)


def test_int4_groups_and_layout() -> None:
    """Every group size: the kernel reads the nibble layout quant_int4 writes (a column swap would show)."""
    w = torch.zeros(3, 128)
    w[0, 5], w[1, 64 + 40], w[2, 127] = 1.0, -2.0, 3.0  # one non-zero column per row, in different halves
    # (each group holds 0 and at most one other value: its minimum and maximum, the ends of its grid)
    x = torch.arange(128, dtype=torch.float32).view(1, 128) + 1
    for group in (32, 64, 128):
        q, s = quantize_int4(w, group)
        assert torch.allclose(dequantize_int4(q, s, torch.float32), w, atol=1e-6)
        got = torch.ops.trtprompt.few_rows_linear(x, q, s, group)
        assert torch.allclose(got, torch.tensor([[6.0, -2.0 * 105, 3.0 * 128]]), atol=1e-3)


def test_kernel_refuses_what_it_cannot_read() -> None:
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="float32, bfloat16, int8 or uint8"):
        torch.ops.trtprompt.few_rows_linear(x, torch.zeros(4, 64, dtype=torch.float16), None, 0)
    with pytest.raises(RuntimeError, match="need a contiguous float32 scale"):
        torch.ops.trtprompt.few_rows_linear(x, torch.zeros(4, 64, dtype=torch.int8), None, 0)
    with pytest.raises(RuntimeError, match="x has 64 columns, the weight 32"):
        torch.ops.trtprompt.few_rows_linear(x, torch.zeros(4, 32), None, 0)
    with pytest.raises(RuntimeError, match="int4 group"):
        torch.ops.trtprompt.few_rows_linear(x, torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 3, 2), 24)
    with pytest.raises(RuntimeError, match=r"int4 scale must be \[N, K / group, 2\]"):
        torch.ops.trtprompt.few_rows_linear(x, torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2), 32)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_linear_on_both_sides_of_the_threshold(fmt: str, dtype: torch.dtype) -> None:
    stored, scale, _ = _weights(48, 96 if fmt == "int8" else 128, 32, seed=2)[fmt]
    assert scale is not None
    bias = torch.randn(48).to(dtype)
    linear = make_linear(stored, bias, "onednn", dtype, scale)
    assert isinstance(linear, WeightOnlyLinear) and linear.qweight.dtype == stored.dtype  # kept quantized
    w = dequantize(stored, scale, dtype)
    for m in (1, 9, FEW_ROWS_MAX, FEW_ROWS_MAX + 1):
        x = torch.randn(m, w.shape[1]).to(dtype)
        want = F.linear(x.float(), w.float(), bias.float())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(linear(x).float(), want, rtol=tol, atol=tol * want.abs().max().item()), m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_runs_its_fewest_rows_on_the_kernel(dtype: torch.dtype) -> None:
    if not onednn_available(dtype, torch.device("cpu")):
        pytest.skip(f"no oneDNN {dtype} on this CPU")
    gen = torch.Generator().manual_seed(4)
    # 40 x 80: neither whole AMX tiles nor whole panels, so this path runs where the AMX (test_amx_linear.py) and
    # panel (test_panel_linear.py) kernels do too
    w, bias = (torch.randn(40, 80, generator=gen) * 0.05).to(dtype), torch.randn(40, generator=gen).to(dtype)
    linear = make_linear(w, bias, "onednn", dtype)
    assert isinstance(linear, DenseFewRowsLinear) and linear.few_rows_max == DENSE_FEW_ROWS_MAX[dtype]
    packed_only = make_linear(w, bias, "onednn", dtype, few_rows=False)
    assert type(packed_only) is OneDnnLinear
    for m in (1, DENSE_FEW_ROWS_MAX[dtype], DENSE_FEW_ROWS_MAX[dtype] + 1, 40):
        x = torch.randn(m, 80, generator=gen).to(dtype)
        # Bit-identical to the path that should have run: the kernel up to the bound, oneDNN past it.
        if m <= linear.few_rows_max:
            path = torch.ops.trtprompt.few_rows_linear(x, w, None, 0) + bias
        else:
            path = packed_only(x)
        assert torch.equal(linear(x), path), m
        want = F.linear(x.float(), w.float(), bias.float())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(linear(x).float(), want, rtol=tol, atol=tol * want.abs().max().item()), m


def test_reference_backend_dequantizes_at_load() -> None:
    stored, scale, _ = _weights(16, 64, 32, seed=3)["int4"]
    assert scale is not None
    linear = make_linear(stored, None, "reference", torch.float32, scale)
    assert not isinstance(linear, WeightOnlyLinear)
    assert few_rows_available(torch.float32, torch.device("cpu"), 64)
    assert not few_rows_available(torch.float16, torch.device("cpu"), 64)

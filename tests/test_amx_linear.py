"""The bf16 AMX linear (csrc/amx_linear.cpp, engine/amx_linear.py) against plain torch.

The tile packing is checked element by element everywhere; the kernel where this CPU has AMX-BF16 and the
avx512 kernel variant runs (tests/test_kernel_variants.py runs `amx_is_ready` in the other variants, where it
must say no): bf16, int8 and int4 weights at every row count around its 16-row tiles and 32-row passes, an odd
count of 16-column blocks, with and without a bias, and each linear on both sides of its bounds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtprompt.engine import amx_linear as amx
from trtprompt.engine import isa, kernels
from trtprompt.engine.linear import DenseFewRowsLinear, OneDnnLinear, WeightOnlyLinear, dequantize, make_linear
from trtprompt.engine.quant_int4 import dequantize_int4, quantize_int4
from trtprompt.engine.quant_w8a8 import quantize_int8

CPU = torch.device("cpu")
HAVE_AMX = kernels.compiled_kernel_status()[0] and amx.amx_available(torch.bfloat16, CPU, 16, 32)
needs_amx = pytest.mark.skipif(not HAVE_AMX, reason="no AMX-BF16 here (CPU or kernel variant)")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.1).bfloat16()


def test_pack_tiles_puts_each_weight_where_the_kernel_reads_it() -> None:
    w = torch.arange(48 * 96, dtype=torch.float32).view(48, 96)  # every value distinct
    packed = amx.pack_tiles(w)
    assert packed.shape == (3, 3, 16, 32) and packed.is_contiguous()
    for nb, kb, r, c, j in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 2, 15, 3, 1), (2, 1, 7, 15, 0), (2, 2, 15, 15, 1)]:
        assert packed[nb, kb, r, 2 * c + j] == w[16 * nb + c, 32 * kb + 2 * r + j], (nb, kb, r, c, j)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_pack_int4_tiles_holds_each_code_and_its_group_where_the_kernel_reads_them(group: int) -> None:
    n, k = 32, 256
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(12))
    q, scale = quantize_int4(w, group)
    tiles, scales = amx.pack_int4_tiles(q, scale)
    assert tiles.shape == (2, 8, 16, 16) and tiles.dtype == torch.uint8 and scales.shape == (2, 8, 2, 16)
    # the codes by column, as dequantize_int4 reads them: (w - minimum) / scale
    codes = ((dequantize_int4(q, scale, torch.float32) - scale[:, :, 1].repeat_interleave(group, 1))
             / scale[:, :, 0].repeat_interleave(group, 1)).round().to(torch.uint8)
    flat = tiles.reshape(2, 8, 256)
    for nb, kb, r, c, j in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 7, 15, 15, 1), (0, 3, 8, 5, 0), (1, 2, 7, 9, 1)]:
        e = 32 * r + 2 * c + j  # the element of amx.pack_tiles' tile
        byte = flat[nb, kb, e % 256]
        assert (byte >> 4 if e >= 256 else byte & 15) == codes[16 * nb + c, 32 * kb + 2 * r + j], (nb, kb, r, c, j)
        g = 32 * kb // group
        assert scales[nb, kb, 0, c] == scale[16 * nb + c, g, 0] and scales[nb, kb, 1, c] == scale[16 * nb + c, g, 1]


def test_amx_is_ready_exactly_where_the_variant_and_cpu_have_it() -> None:
    if not kernels.compiled_kernel_status()[0]:
        pytest.skip("compiled kernels unavailable")
    flags = isa.cpu_flags()
    expected = kernels.variant().name == "avx512" and {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags
    assert bool(torch.ops.trtprompt.amx_bf16_ready()) == expected
    assert amx.amx_available(torch.bfloat16, CPU, 64, 96) == expected
    assert not amx.amx_available(torch.bfloat16, CPU, 64, 80)  # 80 columns: not whole 32-column tiles
    assert not amx.amx_available(torch.bfloat16, CPU, 40, 96)  # 40 rows: not whole 16-row tiles
    assert not amx.amx_available(torch.float32, CPU, 64, 96)


@needs_amx
@pytest.mark.parametrize("n", [48, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_tiles_match_torch_at_every_row_count(n: int, with_bias: bool) -> None:
    k = 96
    w = _bf16(n, k, seed=1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)) if with_bias else None
    packed = amx.pack_tiles(w)
    for m in (1, 2, 15, 16, 17, 31, 32, 33, 48, 70):
        x = _bf16(m, k, seed=m)
        got = torch.ops.trtprompt.amx_linear(x, packed, None, bias)
        want = x.float() @ w.float().t() + (0 if bias is None else bias)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # products are exact in float32 and summed in another order; the output is rounded to bf16 once
        assert torch.allclose(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item()), m


@needs_amx
def test_kernel_refuses_what_it_cannot_read() -> None:
    packed = amx.pack_tiles(_bf16(16, 64, seed=3))
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16"):
        torch.ops.trtprompt.amx_linear(torch.randn(2, 64), packed, None, None)
    with pytest.raises(RuntimeError, match="x has 32 columns, the packed weight 64"):
        torch.ops.trtprompt.amx_linear(_bf16(2, 32, seed=4), packed, None, None)
    with pytest.raises(RuntimeError, match="packed must be a contiguous bfloat16"):
        torch.ops.trtprompt.amx_linear(_bf16(2, 64, seed=4), packed.view(16, 64), None, None)
    with pytest.raises(RuntimeError, match="an int8 or int4 packed weight needs its scale, a bf16 one none"):
        torch.ops.trtprompt.amx_linear(_bf16(2, 64, seed=4), packed, torch.ones(16), None)
    int8_tiles = amx.pack_tiles(torch.ones(16, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="an int8 or int4 packed weight needs its scale"):
        torch.ops.trtprompt.amx_linear(_bf16(2, 64, seed=4), int8_tiles, None, None)
    with pytest.raises(RuntimeError, match=r"an int8 weight's scale must be a contiguous float32 \[N\]"):
        torch.ops.trtprompt.amx_linear(_bf16(2, 64, seed=4), int8_tiles, torch.ones(8), None)
    with pytest.raises(RuntimeError, match=r"an int4 weight's scale must be a contiguous float32 \[N / 16"):
        torch.ops.trtprompt.amx_linear(_bf16(2, 64, seed=4), torch.zeros(1, 2, 16, 16, dtype=torch.uint8),
                                       torch.ones(16), None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        torch.ops.trtprompt.amx_linear(_bf16(2, 64, seed=4), packed, None, torch.zeros(16, dtype=torch.bfloat16))
    assert torch.ops.trtprompt.amx_linear(_bf16(0, 64, seed=4), packed, None, None).shape == (0, 16)


@needs_amx
def test_linear_runs_its_decode_rows_on_amx_and_the_rest_on_onednn() -> None:
    w, bias = _bf16(64, 96, seed=5), _bf16(64, seed=6)
    linear = make_linear(w, bias, "onednn", torch.bfloat16)
    assert isinstance(linear, amx.AmxLinear) and type(linear.dense) is OneDnnLinear
    for m in (1, amx.AMX_ROWS_MAX, amx.AMX_ROWS_MAX + 1, 100):
        x = _bf16(m, 96, seed=10 + m)
        # Bit-identical to the path that should have run: AMX up to the bound, oneDNN past it.
        path = (torch.ops.trtprompt.amx_linear(x, linear.packed, None, bias.float()) if m <= amx.AMX_ROWS_MAX
                else linear.dense(x))
        assert torch.equal(linear(x), path), m
        want = F.linear(x.float(), w.float(), bias.float())
        assert torch.allclose(linear(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item()), m
    # Where the shape is not whole tiles, the few-rows kernel takes the fewest rows as before.
    assert isinstance(make_linear(_bf16(48, 80, seed=7), None, "onednn", torch.bfloat16), DenseFewRowsLinear)


@needs_amx
@pytest.mark.parametrize("n", [48, 64])
def test_int8_tiles_match_torch_at_every_row_count(n: int) -> None:
    """int8 weight-only: tiles widened to bf16 as one pass reads them, or a block at a time for more passes."""
    k = 96
    q, scale = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(8)) * 0.05)
    w = dequantize(q, scale, torch.float32)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(9))
    tiles = amx.pack_tiles(q)
    assert tiles.dtype == torch.int8
    for m in (1, 2, 16, 17, 32, 33, 70):
        x = _bf16(m, k, seed=20 + m)
        got = torch.ops.trtprompt.amx_linear(x, tiles, scale.float(), bias)
        want = x.float() @ w.t() + bias
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert torch.allclose(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item()), m


@needs_amx
def test_weight_only_int8_runs_its_middle_rows_on_amx() -> None:
    q, scale = quantize_int8(torch.randn(64, 96, generator=torch.Generator().manual_seed(10)) * 0.05)
    bias = _bf16(64, seed=11)
    linear = make_linear(q, bias, "onednn", torch.bfloat16, scale)
    assert isinstance(linear, WeightOnlyLinear) and linear.tiles is not None
    for m in (1, amx.AMX_INT8_ROWS.start, amx.AMX_INT8_ROWS.stop - 1, amx.AMX_INT8_ROWS.stop):
        x = _bf16(m, 96, seed=30 + m)
        if m in amx.AMX_INT8_ROWS:  # bit-identical to the path that should have run
            path = torch.ops.trtprompt.amx_linear(x, linear.tiles, linear.scale, bias.float())
        elif m == 1:
            path = torch.ops.trtprompt.few_rows_linear(x, q, linear.scale, 0) + bias
        else:
            path = F.linear(x, dequantize(q, scale, torch.bfloat16), bias)
        assert torch.equal(linear(x), path), m
    # float32 activations keep the few-rows kernel: no tiles
    linear32 = make_linear(q, None, "onednn", torch.float32, scale)
    assert isinstance(linear32, WeightOnlyLinear) and linear32.tiles is None


@needs_amx
@pytest.mark.parametrize("group", [32, 128])
def test_int4_tiles_match_the_dense_path_at_every_row_count(group: int) -> None:
    """int4: each tile widened to q * scale + minimum in bf16, as the dense path dequantizes it."""
    n, k = 48, 256
    q, scale = quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(13)) * 0.05, group)
    w = dequantize_int4(q, scale, torch.bfloat16).float()  # the weight the dense path multiplies by
    bias = torch.randn(n, generator=torch.Generator().manual_seed(14))
    tiles, scales = amx.pack_int4_tiles(q, scale)
    for m in (1, 2, 16, 17, 32, 33, 70):
        x = _bf16(m, k, seed=40 + m)
        got = torch.ops.trtprompt.amx_linear(x, tiles, scales, bias)
        want = x.float() @ w.t() + bias
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert torch.allclose(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item()), m


@needs_amx
def test_weight_only_int4_runs_its_rows_on_amx() -> None:
    q, scale = quantize_int4(torch.randn(64, 128, generator=torch.Generator().manual_seed(15)) * 0.05, 32)
    linear = make_linear(q, None, "onednn", torch.bfloat16, scale)
    assert isinstance(linear, WeightOnlyLinear) and linear.tiles is not None and linear.amx_rows == amx.AMX_INT4_ROWS
    for m in (1, amx.AMX_INT4_ROWS.start, amx.AMX_INT4_ROWS.stop - 1, amx.AMX_INT4_ROWS.stop):
        x = _bf16(m, 128, seed=50 + m)
        if m in amx.AMX_INT4_ROWS:  # bit-identical to the path that should have run
            path = torch.ops.trtprompt.amx_linear(x, linear.tiles, linear.tile_scale, None)
        elif m < amx.AMX_INT4_ROWS.start:
            path = torch.ops.trtprompt.few_rows_linear(x, q, linear.scale, 32)
        else:
            path = F.linear(x, dequantize(q, scale, torch.bfloat16))
        assert torch.equal(linear(x), path), m

"""The bf16 AMX linear (csrc/amx_linear.cpp, engine/amx_linear.py) against plain torch.

The tile packing is checked element by element everywhere; the kernel where this CPU has AMX-BF16 and the
avx512 kernel variant runs (tests/test_kernel_variants.py runs `amx_is_ready` in the other variants, where it
must say no): every row count around its 16-row tiles and 32-row passes, an odd count of 16-column blocks,
with and without a bias, and the linear on both sides of AMX_ROWS_MAX.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtprompt.engine import isa, kernels
from trtprompt.engine.amx_linear import AMX_ROWS_MAX, AmxLinear, amx_available, pack_tiles
from trtprompt.engine.linear import DenseFewRowsLinear, OneDnnLinear, make_linear

CPU = torch.device("cpu")
HAVE_AMX = kernels.compiled_kernel_status()[0] and amx_available(torch.bfloat16, CPU, 16, 32)
needs_amx = pytest.mark.skipif(not HAVE_AMX, reason="no AMX-BF16 here (CPU or kernel variant)")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.1).bfloat16()


def test_pack_tiles_puts_each_weight_where_the_kernel_reads_it() -> None:
    w = torch.arange(48 * 96, dtype=torch.float32).view(48, 96)  # every value distinct
    packed = pack_tiles(w)
    assert packed.shape == (3, 3, 16, 32) and packed.is_contiguous()
    for nb, kb, r, c, j in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 2, 15, 3, 1), (2, 1, 7, 15, 0), (2, 2, 15, 15, 1)]:
        assert packed[nb, kb, r, 2 * c + j] == w[16 * nb + c, 32 * kb + 2 * r + j], (nb, kb, r, c, j)


def test_amx_is_ready_exactly_where_the_variant_and_cpu_have_it() -> None:
    if not kernels.compiled_kernel_status()[0]:
        pytest.skip("compiled kernels unavailable")
    flags = isa.cpu_flags()
    expected = kernels.variant().name == "avx512" and {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags
    assert bool(torch.ops.trtprompt.amx_bf16_ready()) == expected
    assert amx_available(torch.bfloat16, CPU, 64, 96) == expected
    assert not amx_available(torch.bfloat16, CPU, 64, 80)  # 80 columns: not whole 32-column tiles
    assert not amx_available(torch.bfloat16, CPU, 40, 96)  # 40 rows: not whole 16-row tiles
    assert not amx_available(torch.float32, CPU, 64, 96)


@needs_amx
@pytest.mark.parametrize("n", [48, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_tiles_match_torch_at_every_row_count(n: int, with_bias: bool) -> None:
    k = 96
    w = _bf16(n, k, seed=1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)) if with_bias else None
    packed = pack_tiles(w)
    for m in (1, 2, 15, 16, 17, 31, 32, 33, 48, 70):
        x = _bf16(m, k, seed=m)
        got = torch.ops.trtprompt.amx_linear(x, packed, bias)
        want = x.float() @ w.float().t() + (0 if bias is None else bias)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # products are exact in float32 and summed in another order; the output is rounded to bf16 once
        assert torch.allclose(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item()), m


@needs_amx
def test_kernel_refuses_what_it_cannot_read() -> None:
    packed = pack_tiles(_bf16(16, 64, seed=3))
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16"):
        torch.ops.trtprompt.amx_linear(torch.randn(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="x has 32 columns, the packed weight 64"):
        torch.ops.trtprompt.amx_linear(_bf16(2, 32, seed=4), packed, None)
    with pytest.raises(RuntimeError, match="packed must be a contiguous bfloat16"):
        torch.ops.trtprompt.amx_linear(_bf16(2, 64, seed=4), packed.view(16, 64), None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        torch.ops.trtprompt.amx_linear(_bf16(2, 64, seed=4), packed, torch.zeros(16, dtype=torch.bfloat16))
    assert torch.ops.trtprompt.amx_linear(_bf16(0, 64, seed=4), packed, None).shape == (0, 16)


@needs_amx
def test_linear_runs_its_decode_rows_on_amx_and_the_rest_on_onednn() -> None:
    w, bias = _bf16(64, 96, seed=5), _bf16(64, seed=6)
    linear = make_linear(w, bias, "onednn", torch.bfloat16)
    assert isinstance(linear, AmxLinear) and type(linear.dense) is OneDnnLinear
    for m in (1, AMX_ROWS_MAX, AMX_ROWS_MAX + 1, 100):
        x = _bf16(m, 96, seed=10 + m)
        # Bit-identical to the path that should have run: AMX up to the bound, oneDNN past it.
        path = (torch.ops.trtprompt.amx_linear(x, linear.packed, bias.float()) if m <= AMX_ROWS_MAX
                else linear.dense(x))
        assert torch.equal(linear(x), path), m
        want = F.linear(x.float(), w.float(), bias.float())
        assert torch.allclose(linear(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item()), m
    # Where the shape is not whole tiles, the few-rows kernel takes the fewest rows as before.
    assert isinstance(make_linear(_bf16(48, 80, seed=7), None, "onednn", torch.bfloat16), DenseFewRowsLinear)

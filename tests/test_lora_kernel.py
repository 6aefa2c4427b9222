"""The LoRA runs kernel (csrc/lora_runs.cpp) against plain torch, shape by shape.

Ranks that neither the kernel's weight-rows-at-once (2, 4 or 8) nor anything else divides, an output width
that leaves a scalar tail (40), runs of 1 to 17 rows (one to three tasks of 8), rows of no adapter, strided
inputs, float32 and bfloat16 activations and weights; bfloat16 outputs rounded once, to nearest even, as
torch rounds; and bounds refused before any write. The engine's paths against PEFT: test_lora_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from trtprompt.engine import kernels

pytestmark = pytest.mark.skipif(not kernels.compiled_kernel_status()[0], reason="compiled kernels unavailable")

K = 32  # a multiple of both variants' lanes (8, 16)
# (slot, rank, out_offset, out_features) of each pair; slot 1 has three modules, slot 2 one, slot 0 none.
PAIRS = [(1, 3, 0, 40), (1, 16, 40, 16), (1, 5, 56, 24), (2, 1, 0, 40), (3, 9, 40, 40)]
N = 80
ROW_SLOT = [1] * 17 + [-1, -1] + [2] + [3] * 9 + [1, 1] + [-1] + [3]


def _pairs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(a [C, K], b flat, fields [P, 6], each pair's (A [rank, K], B [rank, out])) as stacks.py lays them out."""
    gen = torch.Generator().manual_seed(seed)
    mats, fields, row, offset = [], [], 0, 0
    for slot, rank, out_offset, out in PAIRS:
        a, b = torch.randn(rank, K, generator=gen), torch.randn(rank, out, generator=gen)
        mats.append((a, b))
        fields.append([slot, row, rank, offset, out_offset, out])
        row, offset = row + rank, offset + rank * out
    a_rows = torch.cat([a for a, _ in mats])
    b_flat = torch.cat([b.reshape(-1) for _, b in mats])
    return a_rows, b_flat, torch.tensor(fields, dtype=torch.long), mats


def _runs(row_slot: list[int]) -> torch.Tensor:
    from trtprompt.engine.lora.stacks import slot_runs

    return torch.tensor(slot_runs(row_slot), dtype=torch.long)


def _expected(y: torch.Tensor, x: torch.Tensor, mats: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """float64 products added to y, row by row (rows of no adapter, or of an adapter with no pair, unchanged)."""
    out = y.double()
    for t, slot in enumerate(ROW_SLOT):
        for (s, _, off, width), (a, b) in zip(PAIRS, mats):
            if s == slot:
                out[t, off:off + width] += (x[t].double() @ a.double().t()) @ b.double()
    return out


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_every_run_gets_its_adapters_products_and_nothing_else(x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    a, b, fields, mats = _pairs(seed=0)
    a, b = a.to(w_dtype), b.to(w_dtype)
    mats = [(ma.to(w_dtype).float(), mb.to(w_dtype).float()) for ma, mb in mats]  # what the kernel reads
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(len(ROW_SLOT), K + 16, generator=gen).to(x_dtype)
    x = wide[:, 8:8 + K]  # rows 48 apart: the kernel follows the row stride
    y = torch.randn(len(ROW_SLOT), N, generator=gen).to(x_dtype)
    want = _expected(y, x, mats)
    got = y.clone()
    torch.ops.trtprompt.lora_runs(got, x, _runs(ROW_SLOT), a, b, fields)
    untouched = [t for t, s in enumerate(ROW_SLOT) if s not in (1, 2, 3)]
    assert torch.equal(got[untouched], y[untouched])
    assert torch.equal(got[ROW_SLOT.index(2), 40:], y[ROW_SLOT.index(2), 40:])  # slot 2's pair covers 0:40 only
    if x_dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    else:  # one rounding of the float32 sum: within one bfloat16 step of the exact value
        step = want.abs().clamp_min(1e-3) * 2.0 ** -7
        assert bool(((got.double() - want).abs() <= step).all())


def test_bfloat16_outputs_round_to_nearest_even_as_torch_and_keep_nans() -> None:
    """delta = B exactly (A one-hot, x = e_0, rank 1): y + B rounded by the kernel equals torch's rounding, ties
    included; a NaN in y stays a NaN."""
    width = 64
    base = torch.randn(width, generator=torch.Generator().manual_seed(2)).bfloat16().float()
    ulp = base.abs() * 2.0 ** -8  # half a bfloat16 step (7 stored bits) around each value: ties and near-ties
    b = torch.cat([base + ulp, base - ulp, base + 0.6 * ulp, base - 0.4 * ulp]).reshape(1, -1)
    n = b.shape[1]
    a = torch.zeros(1, K)
    a[0, 0] = 1.0
    x = torch.zeros(1, K, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    y = torch.zeros(1, n, dtype=torch.bfloat16)
    y[0, 3] = float("nan")
    fields = torch.tensor([[0, 0, 1, 0, 0, n]], dtype=torch.long)
    torch.ops.trtprompt.lora_runs(y, x, torch.tensor([[0, 1, 0]]), a, b.reshape(-1).contiguous(), fields)
    want = b.to(torch.bfloat16)
    assert torch.isnan(y[0, 3])
    keep = [i for i in range(n) if i != 3]
    assert torch.equal(y[0, keep], want[0, keep])


@pytest.mark.parametrize(("runs", "fields_change", "message"), [
    ([[0, 40, 1]], None, "run 0 is outside y"),
    ([[5, 3, 1]], None, "run 0 is outside y"),
    ([[0, 2, 1]], (0, 1, 50), "pair 0's A rows are outside a"),
    ([[0, 2, 1]], (4, 4, 60), "pair 4's columns are outside y"),
    ([[0, 2, 1]], (2, 3, 10_000), "pair 2's B is outside b"),
])
def test_bounds_are_refused_before_any_write(runs: list[list[int]], fields_change: tuple[int, int, int] | None,
                                            message: str) -> None:
    a, b, fields, _ = _pairs(seed=3)
    if fields_change is not None:
        pair, field, value = fields_change
        fields[pair, field] = value
    x, y = torch.randn(len(ROW_SLOT), K), torch.randn(len(ROW_SLOT), N)
    before = y.clone()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.trtprompt.lora_runs(y, x, torch.tensor(runs, dtype=torch.long), a, b, fields)
    assert torch.equal(y, before)


def test_mixed_dtypes_and_widths_off_the_vector_are_refused() -> None:
    a, b, fields, _ = _pairs(seed=4)
    runs = _runs(ROW_SLOT)
    x, y = torch.randn(len(ROW_SLOT), K), torch.randn(len(ROW_SLOT), N)
    with pytest.raises(RuntimeError, match="y and x must both be float32 or both bfloat16"):
        torch.ops.trtprompt.lora_runs(y.bfloat16(), x, runs, a, b, fields)
    with pytest.raises(RuntimeError, match="a and b must both be float32 or both bfloat16"):
        torch.ops.trtprompt.lora_runs(y, x, runs, a.bfloat16(), b, fields)
    with pytest.raises(RuntimeError, match=r"K \(36\) must be a multiple of"):
        torch.ops.trtprompt.lora_runs(y, torch.randn(len(ROW_SLOT), 36), runs, torch.randn(a.shape[0], 36), b, fields)

"""Compiled layer ops (csrc/fused_ops.cpp) against transformers' torch expressions (TorchOps)."""

from __future__ import annotations

import pytest
import torch

from trtprompt.engine import kernels
from trtprompt.engine.layer_ops import CompiledOps, TorchOps, layer_ops

pytestmark = pytest.mark.skipif(not kernels.compiled_kernel_status()[0],
                                reason=f"compiled kernels unavailable: {kernels.compiled_kernel_status()[1]}")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal but for the last bit of exp/sqrt and float32 reduction order."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.float32:
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
        return
    ulp = torch.finfo(a.dtype).eps
    torch.testing.assert_close(b.float(), a.float(), rtol=2 * ulp, atol=0.0)
    assert (a != b).float().mean().item() < 0.01  # rounding placed where torch places it


def rotary_inputs(t: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.randint(0, 4096, (t,), generator=gen)[:, None].float() * inv
    return freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 512), (33, 512), (300, 64), (5, 100), (4, 2048)])
def test_rms_norm(dtype: torch.dtype, rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    w = torch.randn(n, generator=gen).to(dtype)
    close(TorchOps().rms_norm(x, w, 1e-6), CompiledOps().rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (37, 576), (4, 2048)])
def test_add_rms_norm(dtype: torch.dtype, rows: int, n: int) -> None:
    """The residual add rounded as torch's add, then the norm of the sum; and no add for the first layer."""
    gen = torch.Generator().manual_seed(rows + n)
    x, delta = (torch.randn(rows, n, generator=gen) * 3).to(dtype), torch.randn(rows, n, generator=gen).to(dtype)
    w = torch.randn(n, generator=gen).to(dtype)
    want_sum, want = TorchOps().add_rms_norm(x, delta, w, 1e-5)
    got_sum, got = CompiledOps().add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(got_sum, want_sum) and torch.equal(want_sum, x + delta)
    close(want, got)
    first_sum, first = CompiledOps().add_rms_norm(x, None, w, 1e-5)
    assert first_sum is x
    close(TorchOps().rms_norm(x, w, 1e-5), first)


def test_rms_norm_of_a_head_view() -> None:
    """q/k norms (Qwen3) normalise [T, heads, d] views of the fused qkv output."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 16 * 64, generator=gen)
    q = qkv[:, :8 * 64].view(9, 8, 64)
    w = torch.randn(64, generator=gen)
    close(TorchOps().rms_norm(q, w, 1e-5), CompiledOps().rms_norm(q, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1376), (32, 1376), (7, 13), (2048, 64)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    gu = (torch.randn(rows, 2 * n, generator=gen) * 6).to(dtype)
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0]).to(dtype)  # exponent far out of range both ways, and 0
    close(TorchOps().silu_and_mul(gu), CompiledOps().silu_and_mul(gu))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [48, 64, 128, 256])
def test_rotary_of_qkv_views(dtype: torch.dtype, d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    t, heads, kv_heads = 11, 4, 2
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, :heads * d].view(t, heads, d)  # rows strided by the fused width
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    cos, sin = rotary_inputs(t, d, dtype, gen)
    torch_ops, compiled = TorchOps(), CompiledOps()
    for x in (q, k, q.contiguous()):  # each with its own step tables (rotary_tables), as the model passes them
        want = torch_ops.rotary(x, *torch_ops.rotary_tables(cos, sin))
        got = compiled.rotary(x, *compiled.rotary_tables(cos, sin))
        close(want, got)
        if dtype == torch.bfloat16:  # products, sums and roundings only (no exp, no sqrt): bit for bit, vector
            assert torch.equal(got, want)  # body and tail (d 48 on AVX-512: 16 lanes, then 8)


def test_the_compiled_backend_brings_the_compiled_ops() -> None:
    assert isinstance(layer_ops("compiled"), CompiledOps)
    assert isinstance(layer_ops("torch"), TorchOps)
    assert isinstance(layer_ops("reference"), TorchOps)

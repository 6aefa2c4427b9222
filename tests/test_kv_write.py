"""The compiled KV write (csrc/kv_write.cpp) stores what the torch index assignment stores."""

from __future__ import annotations

import pytest
import torch

from trtprompt.engine import kernels

pytestmark = pytest.mark.skipif(not kernels.compiled_kernel_status()[0], reason="compiled kernels unavailable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_matches_index_assignment(dtype: torch.dtype) -> None:
    blocks, heads, tpb, d, t = 6, 3, 4, 16, 7
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (3 + 2 * heads) * d, generator=gen).to(dtype)
    k = qkv[:, 3 * d:(3 + heads) * d].view(t, heads, d)  # strided views of a fused output, as the model passes
    v = qkv[:, (3 + heads) * d:].view(t, heads, d)
    slot_blocks = torch.tensor([5, 5, 0, 2, 2, 2, 3])
    slot_offsets = torch.tensor([0, 3, 1, 0, 1, 2, 3])
    want_k, want_v = torch.zeros(blocks, heads, tpb, d, dtype=dtype), torch.zeros(blocks, heads, tpb, d, dtype=dtype)
    want_k[slot_blocks, :, slot_offsets] = k
    want_v[slot_blocks, :, slot_offsets] = v
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    torch.ops.trtprompt.write_kv(got_k, got_v, k, v, slot_blocks, slot_offsets)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_write_kv_refuses_a_slot_outside_the_cache() -> None:
    cache = torch.zeros(2, 1, 4, 16)
    rows = torch.ones(1, 1, 16)
    with pytest.raises(RuntimeError, match=r"slot \(2, 0\) outside the cache"):
        torch.ops.trtprompt.write_kv(cache, cache.clone(), rows, rows, torch.tensor([2]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="dtype differs"):
        torch.ops.trtprompt.write_kv(cache, cache.clone(), rows.double(), rows, torch.tensor([0]), torch.tensor([0]))

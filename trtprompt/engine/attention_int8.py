"""The int8 KV cache (kv_cache_dtype int8): storage, quantization, and the float view attention reads.

Each cached row (one token of one kv head) is stored as head_size int8 values
followed by its scale, a float16, in the row's last two bytes: the cache tensor
is int8 [blocks, kv_heads, tokens_per_block, head_size + 2]. The scale travels
inside the row so every copy of a block (the tiers' byte views, a block written
to disk or Redis) carries its scales without knowing they are there.

Symmetric per-row scale amax / 127: a row's error is at most half a step of its
own largest value, and one outlier token cannot coarsen its neighbours. float16
is enough for the scale (its rounding, 2^-11, is far below int8's 1/254).

Reading: on the compiled backend every step (decodes, prefill chunks, chunked
context, cascade groups) reads the int8 rows in place (kernels.paged_decode_int8,
kernels.paged_prefill_int8), so no float copy of the cache exists. The torch and
reference backends, the simple paths tests compare with, read floats:
paged_attention dequantizes every block the step references
(AttentionMetadata.kv_blocks) into a float scratch of the pool's shape, shared by
all layers (they run one after another), and the backend attends to that scratch
unchanged. The scratch is allocated on its first use, so an engine on the compiled
backend never holds it; where it is allocated it is outside the KV budget, and it
says so in the log (its bytes). docs/quantization.md, "KV cache int8", has the
measurements.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from trtprompt.engine.config import KV_INT8_SCALE_BYTES as SCALE_BYTES
from trtprompt.knobs import KNOBS

log = logging.getLogger(__name__)

_QMAX = 127.0


@dataclass(frozen=True)
class FloatScratch:
    """The pool-shaped float (K, V) the torch and reference backends read an int8 cache through,
    shared by every layer and allocated on first use (the compiled backend never uses it)."""

    shape: tuple[int, int, int, int]  # the float pool's [blocks, kv_heads, tokens_per_block, head_size]
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        if len(self.shape) != 4 or min(self.shape) < 1:
            raise ValueError(f"FloatScratch.shape must be four sizes >= 1, got {self.shape}")

    @functools.cached_property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Zeros, never garbage: padded block-table entries point at blocks a step did not fill,
        # which attention masks out, and a masked NaN would still poison softmax.
        log.info("int8 KV cache: %d bytes of float scratch (one layer's pool as %s) for the non-compiled "
                 "attention backend, outside the KV budget", self.nbytes, self.dtype)
        return (torch.zeros(self.shape, dtype=self.dtype, device=self.device),
                torch.zeros(self.shape, dtype=self.dtype, device=self.device))

    @property
    def nbytes(self) -> int:
        """What the scratch takes once allocated: K and V."""
        return 2 * math.prod(self.shape) * self.dtype.itemsize

    @property
    def allocated_bytes(self) -> int:
        """The scratch's bytes if a step has allocated it, else 0."""
        return self.nbytes if "tensors" in self.__dict__ else 0


class Int8KvCache(tuple[torch.Tensor, torch.Tensor]):
    """One layer's (K, V) int8 rows, with the float scratch the non-compiled backends read them through.

    A tuple so everything that takes a layer's (K, V) (the tiers' byte copies, unpacking)
    takes it as it is; `scratch` is shared by every layer.
    """

    scratch: FloatScratch

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, scratch: FloatScratch) -> "Int8KvCache":
        obj = super().__new__(cls, (k, v))
        obj.scratch = scratch
        return obj


def check_kv_cache_dtype(value: str) -> str:
    return str(KNOBS["kv_cache_dtype"].check(value))


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] float -> int8 [..., d + 2]: the rounded values, then the float16 scale's bytes."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / _QMAX).clamp_max(torch.finfo(torch.float16).max).to(torch.float16)
    # Values are rounded against the stored scale itself, so its rounding adds no error; the smallest
    # subnormal keeps an all-zero row zero without coarsening a row of tiny values.
    safe = scale.float().clamp_min(2.0 ** -24)
    q = torch.round(xf / safe).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., d + 2] rows -> float [..., d] of dtype (values times their row's scale)."""
    d = packed.shape[-1] - SCALE_BYTES
    scale = packed[..., d:].contiguous().view(torch.float16).float()
    return (packed[..., :d].float() * scale).to(dtype)


def write_rows(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Quantize the new tokens' x [T, kv_heads, d] into their slots of an int8 cache; the packed rows.

    What is stored is what every path attends to, the new tokens' own K/V included (the paged path
    reads those straight from the step, not the cache: dequantize_rows of these rows), so all
    backends see the same keys."""
    packed = quantize_rows(x)
    cache[blocks, :, offsets] = packed
    return packed


def fill_scratch(kv: Int8KvCache, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float scratch with `blocks` (the step's) dequantized from kv; its other blocks are stale."""
    k_scratch, v_scratch = kv.scratch.tensors
    for packed, out in zip(kv, (k_scratch, v_scratch)):
        out.index_copy_(0, blocks, dequantize_rows(packed.index_select(0, blocks), out.dtype))
    return k_scratch, v_scratch


def allocate_int8(num_layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                  device: torch.device) -> list[Int8KvCache]:
    """Per layer int8 (K, V) of shape [..., head_size + 2], over one float scratch of `shape` (not yet
    allocated: FloatScratch)."""
    packed = (*shape[:3], shape[3] + SCALE_BYTES)
    scratch = FloatScratch(shape, dtype, device)
    return [Int8KvCache(torch.zeros(packed, dtype=torch.int8, device=device),
                        torch.zeros(packed, dtype=torch.int8, device=device), scratch)
            for _ in range(num_layers)]

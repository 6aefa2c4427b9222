"""Linear layers: a plain `F.linear` reference and a oneDNN prepacked path.

On our CPUs oneDNN with a weight reordered once into its blocked layout runs
2.4-4.4x faster than torch's default (MKL) path (docs/design.md, "Machines"). It applies only on
CPU for dtypes the CPU's oneDNN supports; everywhere else the reference path
runs. W8A16 weights (int8 + per-output-channel scale) are dequantized once
at load: torch's int8 weight-only matmul (`_weight_int8pack_mm`) ran at
~2 GFLOP/s on our AVX2 CPUs, 30x slower than a dense fp32 GEMM. W8A8 weights
stay int8 and run an int8 GEMM (quant_w8a8.py, docs/quantization.md).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from trtprompt.engine.quant_w8a8 import LEGACY_BITS, W8A8Bits, make_w8a8_linear

LINEAR_BACKENDS: tuple[str, ...] = ("onednn", "reference")
# The M a prepacked weight is tuned for; measured insensitive between decode and prefill sizes.
ONEDNN_BATCH_HINT = 32
# Two caches keep an entry per distinct input shape, and the engine's token count changes
# every step: oneDNN's primitive cache (default 1,024 primitives) and, above it, ideep's LRU
# of per-shape computations that torch's _linear_pointwise goes through (LRU_CACHE_CAPACITY,
# default 1,024). Unbounded by use, they made the engine's RSS climb for many rounds of varied
# load (issue 11; docs/benchmarks-history.md "Soak (issue 11)" has the rounds with each cap).
# The caps keep a working set (the few token counts of neighbouring steps) and bound the rest.
# An operator's own values win.
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_CAPACITY = 256
IDEEP_CACHE_ENV = "LRU_CACHE_CAPACITY"
IDEEP_CACHE_CAPACITY = 64


def cap_primitive_cache() -> None:
    """Set both caches' capacities unless the operator did.

    They are read once, when the process first uses them, so this runs before the engine's
    first oneDNN call (onednn_available); in a process that used oneDNN before, the
    capacities it started with stay.
    """
    os.environ.setdefault(ONEDNN_CACHE_ENV, str(ONEDNN_CACHE_CAPACITY))
    os.environ.setdefault(IDEEP_CACHE_ENV, str(IDEEP_CACHE_CAPACITY))


def _onednn_dtype_ok(dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    """True when prepacked oneDNN linears run, and agree with F.linear, for this dtype/device."""
    cap_primitive_cache()
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not _onednn_dtype_ok(dtype):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_BATCH_HINT)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:
        return False
    ref = F.linear(x, w)
    return y.dtype == dtype and torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-1)


def resolve_backend(backend: str, dtype: torch.dtype, device: torch.device) -> str:
    """The backend that will really run: 'onednn' falls back to 'reference' where it cannot."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {backend!r}")
    if backend == "onednn" and not onednn_available(dtype, device):
        return "reference"
    return backend


class DenseLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class OneDnnLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_BATCH_HINT)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (qweight.float() * scale.float()[:, None]).to(dtype)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, backend: str, dtype: torch.dtype,
                scale: torch.Tensor | None = None, w8a8_backend: str | None = None,
                w8a8_bits: W8A8Bits = LEGACY_BITS) -> torch.nn.Module:
    """A linear for `weight` [out, in] (int8 when `scale` is given) on an already resolved backend.

    int8 weights run the W8A8 kernel `w8a8_backend` when one is given, else are dequantized (W8A16).
    """
    if scale is not None and w8a8_backend is not None:
        return make_w8a8_linear(weight, scale, bias, w8a8_backend, w8a8_bits)
    if scale is not None:
        weight = dequantize(weight, scale, dtype)
    if backend == "onednn":
        return OneDnnLinear(weight, bias)
    return DenseLinear(weight, bias)

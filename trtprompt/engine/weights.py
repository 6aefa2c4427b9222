"""Read decoder weights under their Hugging Face names, optionally with int8 linears.

With quant_algo "W8A16" (int8 weight-only) or "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN" (int8 weights and
activations, docs/quantization.md) each linear inside the layers is int8 [out, in] with
`<name>_scale` float32 [out] (w ~= int8 * scale[:, None]); embeddings, norms
and lm_head stay in the engine dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

W8A16 = "W8A16"
# TensorRT-LLM's name for per-channel weight / per-token activation int8 (its SmoothQuant format; an
# unsmoothed checkpoint is the case of smoothing factors 1).
W8A8 = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
QUANT_ALGOS: tuple[str, ...] = (W8A16, W8A8)


@dataclass(frozen=True)
class LinearWeights:
    weight: torch.Tensor  # [out, in]: engine dtype, or int8 when scale is set
    bias: torch.Tensor | None
    scale: torch.Tensor | None  # float32 [out] for the int8 algos


def check_quant_algo(quant_algo: str | None) -> None:
    if quant_algo is not None and quant_algo not in QUANT_ALGOS:
        raise ValueError(f"quant_algo must be None or one of {', '.join(QUANT_ALGOS)}, got {quant_algo!r}")


def take_tensor(tensors: Mapping[str, torch.Tensor], name: str, shape: Sequence[int],
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"weight {name!r} is missing from the checkpoint")
    t = tensors[name]
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t.to(device=device, dtype=dtype)


def _take_quantized(tensors: Mapping[str, torch.Tensor], name: str, shape: Sequence[int],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = f"{name}.weight"
    if key in tensors and tensors[key].dtype != torch.int8:
        raise ValueError(f"quantized weight {key!r} must be int8, got {tensors[key].dtype}")
    weight = take_tensor(tensors, key, shape, torch.int8, device)
    scale = take_tensor(tensors, f"{key}_scale", shape[:1], torch.float32, device)
    return weight, scale


def take_linear(tensors: Mapping[str, torch.Tensor], name: str, shape: Sequence[int],
                dtype: torch.dtype, device: torch.device, quantized: bool) -> LinearWeights:
    """`name` without '.weight'; the bias is loaded whenever the checkpoint has one."""
    bias_key = f"{name}.bias"
    bias = take_tensor(tensors, bias_key, shape[:1], dtype, device) if bias_key in tensors else None
    if quantized:
        weight, scale = _take_quantized(tensors, name, shape, device)
        return LinearWeights(weight, bias, scale)
    key = f"{name}.weight"
    if key in tensors and tensors[key].dtype == torch.int8:
        raise ValueError(f"weight {key!r} is int8 but quant_algo is not one of {', '.join(QUANT_ALGOS)}")
    return LinearWeights(take_tensor(tensors, key, shape, dtype, device), bias, None)


def fuse_linears(parts: Sequence[LinearWeights]) -> LinearWeights:
    """One [sum(out), in] linear, so a layer runs one bigger GEMM instead of several small ones."""
    weight = torch.cat([p.weight for p in parts], dim=0)
    scales = [p.scale for p in parts if p.scale is not None]
    if scales and len(scales) != len(parts):
        raise ValueError("fused linears must be all quantized or none")
    scale = torch.cat(scales) if scales else None
    if all(p.bias is None for p in parts):
        return LinearWeights(weight, None, scale)
    ref = next(p.bias for p in parts if p.bias is not None)
    biases = [p.bias if p.bias is not None else ref.new_zeros(p.weight.shape[0]) for p in parts]
    return LinearWeights(weight, torch.cat(biases), scale)

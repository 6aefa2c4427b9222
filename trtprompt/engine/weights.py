"""Read decoder weights under their Hugging Face names, optionally with int8 or int4 linears.

With quant_algo "W8A16" (int8 weight-only) or "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN" (int8 weights and
activations, docs/quantization.md) each linear inside the layers is int8 [out, in] with
`<name>_scale` float32 [out] (w ~= int8 * scale[:, None]); with "W4A16" (int4_wo) it is packed int4
uint8 [out, in / 2] with `<name>_scale` float32 [out, in / group_size, 2] (quant_int4.py). Embeddings, norms
and lm_head stay in the engine dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from trtprompt.engine.quant_int4 import check_group

W8A16 = "W8A16"
W4A16 = "W4A16"  # int4 weight-only in groups (config.json records group_size)
# TensorRT-LLM's name for per-channel weight / per-token activation int8 (its SmoothQuant format; an
# unsmoothed checkpoint is the case of smoothing factors 1).
W8A8 = "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
QUANT_ALGOS: tuple[str, ...] = (W8A16, W8A8, W4A16)


@dataclass(frozen=True)
class LinearWeights:
    weight: torch.Tensor  # [out, in]: engine dtype, or int8 when scale is set; uint8 [out, in / 2]: int4
    bias: torch.Tensor | None
    # float32 [out] for the int8 algos ([out, in / group_size] grouped), [out, in / group_size, 2] for int4
    scale: torch.Tensor | None


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
                    device: torch.device, group_size: int | None, int4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [out, in] + scale [out], or [out, in / group_size] with a group_size (int8_wo's int8_group_size);
    int4: packed int4 [out, in / 2] + (scale, minimum) [out, in / group_size, 2]."""
    key = f"{name}.weight"
    stored = torch.uint8 if int4 else torch.int8
    if key in tensors and tensors[key].dtype != stored:
        want = str(stored).removeprefix("torch.")
        raise ValueError(f"quantized weight {key!r} must be {want}, got {tensors[key].dtype}")
    out_f, in_f = shape
    if group_size is not None:
        check_group(group_size, in_f, "int4" if int4 else "int8")
    if int4 and group_size is not None:
        return (take_tensor(tensors, key, (out_f, in_f // 2), torch.uint8, device),
                take_tensor(tensors, f"{key}_scale", (out_f, in_f // group_size, 2), torch.float32, device))
    scale_shape = (out_f,) if group_size is None else (out_f, in_f // group_size)
    return (take_tensor(tensors, key, shape, torch.int8, device),
            take_tensor(tensors, f"{key}_scale", scale_shape, torch.float32, device))


def take_linear(tensors: Mapping[str, torch.Tensor], name: str, shape: Sequence[int],
                dtype: torch.dtype, device: torch.device, quantized: bool,
                group_size: int | None = None, int4: bool = False) -> LinearWeights:
    """`name` without '.weight'; the bias is loaded whenever the checkpoint has one. group_size: the int8 or int4
    (int4 True) weights' group (quantized only; int4 needs one)."""
    bias_key = f"{name}.bias"
    bias = take_tensor(tensors, bias_key, shape[:1], dtype, device) if bias_key in tensors else None
    if quantized:
        weight, scale = _take_quantized(tensors, name, shape, device, group_size, int4)
        return LinearWeights(weight, bias, scale)
    key = f"{name}.weight"
    if key in tensors and tensors[key].dtype in (torch.int8, torch.uint8):
        raise ValueError(f"weight {key!r} is {tensors[key].dtype} (quantized) but quant_algo is not one of "
                         f"{', '.join(QUANT_ALGOS)}")
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

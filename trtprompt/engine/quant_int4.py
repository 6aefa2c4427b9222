"""int4 weights in groups (int4_wo, quant_algo "W4A16" with a group_size): the format the build writes and
the engine reads.

A weight [out, in] is cut into groups of `group` consecutive input columns per output row; each group has
a float32 scale = (max w - min w) / 15 and minimum, and values q = round((w - min) / scale) in [0, 15]
(asymmetric round-to-nearest, as GGUF's Q4_1 and OpenVINO's default int4_asym are: all 16 levels span the
group's own range; the symmetric grid of Q4_0 left SmolLM2 at +34 % perplexity with groups of 32, this grid
at -0.00 %, docs/quantization.md). Stored two per byte: within a group, byte b holds column b in its low
nibble and column b + group / 2 in its high one, so that a vector of bytes unpacks into two runs of
consecutive columns (csrc/few_rows_linear.cpp reads it that way).

    <name>.weight        uint8   [out, in / 2]
    <name>.weight_scale  float32 [out, in / group, 2]   (scale, minimum) of each group
"""

from __future__ import annotations

import torch

from trtprompt.knobs import INT4_GROUP_SIZES  # noqa: F401  (re-exported: the build knob's choices, declared once)

INT4_LEVELS = 15  # q in [0, 15]: w = q * scale + minimum


def check_group(group: int, in_features: int, what: str = "int4") -> None:
    """what: whose group it is (int4_wo's, or grouped int8_wo's: the same sizes)."""
    if group not in INT4_GROUP_SIZES:
        raise ValueError(f"{what} group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group}")
    if in_features % group:
        raise ValueError(f"{what} group_size {group} does not divide the linear's {in_features} input columns")


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [out, in / 2], (scale, minimum) float32 [out, in / group, 2]) of a float weight [out, in]."""
    out_f, in_f = weight.shape
    check_group(group, in_f)
    w = weight.to(torch.float32).reshape(out_f, in_f // group, group)
    low = w.amin(dim=-1)
    scale = (w.amax(dim=-1) - low).clamp(min=1e-12) / INT4_LEVELS  # a constant group: q = 0, w = minimum exactly
    nibbles = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, INT4_LEVELS).to(torch.uint8)
    half = group // 2
    packed = nibbles[..., :half] | (nibbles[..., half:] << 4)
    return packed.reshape(out_f, in_f // 2).contiguous(), torch.stack((scale, low), dim=-1).contiguous()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [out, in] a packed int4 weight stands for (the reference path, and large-M calls)."""
    out_f, groups, _ = scale.shape
    group = packed.shape[1] * 2 // groups
    p = packed.reshape(out_f, groups, group // 2)
    nibbles = torch.cat((p & 15, p >> 4), dim=-1).to(torch.float32)
    s = scale.to(torch.float32)
    return (nibbles * s[..., 0:1] + s[..., 1:2]).reshape(out_f, groups * group).to(dtype)


def group_of(packed: torch.Tensor, scale: torch.Tensor) -> int:
    """The group size a packed weight and its scales imply."""
    return packed.shape[1] * 2 // scale.shape[1]

"""Rotary position embedding with Hugging Face's rope scaling types.

The inverse frequencies follow transformers' `ROPE_INIT_FUNCTIONS` so that
positions rotate bit-for-bit like the oracle; cos/sin are computed per step
from the packed positions (no table sized by max_position_embeddings, which
is 128k for Llama 3).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from trtprompt.engine.config import ModelConfig

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (base ** exponents)


def _require(scaling: Mapping[str, Any], key: str, rope_type: str) -> Any:
    if scaling.get(key) is None:
        raise ValueError(f"rotary_scaling of rope_type {rope_type!r} needs {key!r}")
    return scaling[key]


def _original_max_positions(cfg: ModelConfig, scaling: Mapping[str, Any]) -> int:
    # transformers' default when a llama3/yarn dict leaves it out.
    return int(scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings)


def _linear(cfg: ModelConfig, scaling: Mapping[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    factor = float(_require(scaling, "factor", "linear"))
    return _base_inv_freq(cfg.rotary_base, dim) / factor, 1.0


def _llama3(cfg: ModelConfig, scaling: Mapping[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(cfg.rotary_base, dim)
    factor = float(_require(scaling, "factor", "llama3"))
    low = float(_require(scaling, "low_freq_factor", "llama3"))
    high = float(_require(scaling, "high_freq_factor", "llama3"))
    old_len = float(_original_max_positions(cfg, scaling))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(scaling: Mapping[str, Any], dim: int, base: float, orig: int) -> tuple[float, float]:
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(cfg: ModelConfig, scaling: Mapping[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    orig = _original_max_positions(cfg, scaling)
    factor = scaling.get("factor") or cfg.max_position_embeddings / orig
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    pos_freqs = cfg.rotary_base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    low, high = _yarn_correction_range(scaling, dim, cfg.rotary_base, orig)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


_INIT: dict[str, Callable[[ModelConfig, Mapping[str, Any], int], tuple[torch.Tensor, float]]] = {
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


def rope_parameters(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_size/2] (float32) and the cos/sin attention scaling."""
    scaling = cfg.rotary_scaling or {}
    rope_type = rope_type_of(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rotary_scaling rope_type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("rotary_scaling partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return _base_inv_freq(cfg.rotary_base, cfg.head_size), 1.0
    return _INIT[rope_type](cfg, scaling, cfg.head_size)


class RotaryEmbedding(torch.nn.Module):
    inv_freq: torch.Tensor  # a buffer (register_buffer), so it follows the module's device

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_parameters(cfg)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_size/2]: computed in float32, rounded to dtype like transformers."""
        freqs = positions[:, None].float() * self.inv_freq
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)
